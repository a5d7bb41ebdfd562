// Key-value store used for rendezvous: ranks publish their addresses, NCCL ids and
// small agreements (model signatures, bucket orders) through it.
//
// Implementations: an in-memory store for ranks that are threads of one process, and
// a TCP store (dtrain's own, see src/comm/store/tcp_store.cpp) for ranks in separate processes
// or on separate hosts. Every blocking call takes a timeout and throws
// dtrain::TimeoutError when it expires.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dtrain {

using Bytes = std::vector<uint8_t>;

class Store {
 public:
  virtual ~Store() = default;

  // Sets key to value, overwriting any previous value, and wakes waiters.
  virtual void set(const std::string& key, const Bytes& value) = 0;

  // Returns key's value, waiting up to timeout for it to be set.
  virtual Bytes get(const std::string& key, std::chrono::milliseconds timeout) = 0;

  // Atomically adds delta to the integer stored at key (0 if absent), returns the result.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;

  // Waits until every key is set or the timeout expires.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;

  // True when every key is set; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;

  // An address of this host that the store's other clients can reach: for a TCP store, the
  // local end of this process's connection to the server (the interface that routes to
  // MASTER_ADDR). Communicators built on the store listen there unless told otherwise
  // (CommunicatorOptions::interface / hostname). Empty for in-process stores.
  virtual std::string network_address() const { return {}; }

  // Convenience wrappers for string values.
  void set(const std::string& key, const std::string& value) {
    set(key, Bytes(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key, std::chrono::milliseconds timeout) {
    Bytes b = get(key, timeout);
    return std::string(b.begin(), b.end());
  }
};

// A store shared by threads of one process (tests, single-process multi-rank tools).
std::shared_ptr<Store> make_memory_store();

// Namespaces every key of `base` under `prefix` + "/": lets several communicators
// (or several runs) share one store without key clashes.
std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> base);

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // address of the server (MASTER_ADDR)
  uint16_t port = 29500;           // its port (MASTER_PORT)
  bool is_server = false;          // true on exactly one process (rank 0)
  // Bound on connecting to the server and on each blocking call.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
};

// A TCP store usable across processes and hosts. The server side also acts as a client.
// Throws dtrain::TimeoutError if the server cannot be reached within options.timeout.
std::shared_ptr<Store> make_tcp_store(const TcpStoreOptions& options);

}  // namespace dtrain

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

  // Job token (DTRAIN_STORE_TOKEN through LaunchInfo), at most 1024 bytes. Every client
  // presents it when it connects; the server refuses one whose token differs (compared in
  // constant time), and that client throws CommError "store at HOST:PORT refused this
  // process: wrong or missing DTRAIN_STORE_TOKEN". Empty on both sides: nothing to check.
  std::string token;

  // Bounds, checked by the client before it sends (InvalidArgument) and by the server for
  // every request (an error reply, the connection stays usable). A frame longer than
  // 5 + max_key_bytes + max_value_bytes cannot be framed: the server closes that client.
  uint32_t max_key_bytes = 4096;
  uint32_t max_value_bytes = 4u << 20;  // 4 MiB; Gloo's address list for 10k ranks is ~1.4 MiB
  // Server only. Connections beyond this are refused ("too many clients"); each also needs
  // a file descriptor (RLIMIT_NOFILE), and accept failures for lack of one back off.
  int max_clients = 4096;
  // Server only. A client whose unread replies exceed this is disconnected, so a client that
  // never reads cannot make the server buffer without bound or delay others. Must be at
  // least max_value_bytes + 16 (one reply to a get).
  size_t max_unread_reply_bytes = 8u << 20;
  // Server only. A connection that has not completed the handshake by then is closed.
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
};

// A TCP store usable across processes and hosts. The server side also acts as a client.
// Throws dtrain::TimeoutError if the server cannot be reached within options.timeout,
// dtrain::CommError if it refuses this process (token, client count), InvalidArgument for
// inconsistent options. The server's thread never ends the process: a malformed, oversized
// or unexpected message costs only the client that sent it.
std::shared_ptr<Store> make_tcp_store(const TcpStoreOptions& options);

}  // namespace dtrain

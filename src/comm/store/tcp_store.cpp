// dtrain's own TCP store: one server thread (on rank 0, store_server.cpp) holding a key-value
// map, and a client per process. Waiting is done by the client, polling check() with backoff,
// so the server never holds per-waiter state and a dead client costs it nothing.
//
// Why not c10d::TCPStore: its C++ API and options differ between LibTorch 1.13 and 2.x and
// it is not part of LibTorch's stable frontend; Gloo's snapshot has no TCP store. This one
// is small, independent of the LibTorch version, and tested here. Wire format: protocol.h.
#include <cerrno>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "comm/net/address.h"
#include "comm/store/protocol.h"
#include "comm/store/socket.h"
#include "comm/store/store_server.h"
#include "dtrain/errors.h"
#include "dtrain/store.h"

namespace dtrain {
namespace {

namespace proto = store_protocol;
using detail::Clock;
using detail::Socket;

std::unique_ptr<detail::StoreServer> serve(const TcpStoreOptions& o) {
  const ErrorContext ctx{-1, -1, "tcp_store.listen", -1};
  try {
    return std::make_unique<detail::StoreServer>(o);
  } catch (const std::system_error& e) {
    if (e.code().value() == EADDRNOTAVAIL) {
      throw CommError(ctx, fmt::format("MASTER_ADDR {} is not an address of this host: the "
                                       "store server (rank 0, --node_rank 0) must run on the "
                                       "host MASTER_ADDR names",
                                       o.host));
    }
    if (e.code().value() == EADDRINUSE) {
      throw CommError(ctx, fmt::format("cannot serve the store on port {} of this host (is it "
                                       "taken? pick another MASTER_PORT): {}",
                                       o.port, e.what()));
    }
    throw CommError(ctx, fmt::format("{}:{}: {}", o.host, o.port, e.what()));
  } catch (const std::exception& e) {
    throw CommError(ctx, fmt::format("{}:{}: {}", o.host, o.port, e.what()));
  }
}

class TcpStore final : public Store {
 public:
  explicit TcpStore(const TcpStoreOptions& o)
      : options_(o), limits_{o.max_key_bytes, o.max_value_bytes, o.max_unread_reply_bytes} {
    if (o.is_server) server_ = serve(o);
    try {
      socket_ = detail::connect_tcp(o.host, o.port, Clock::now() + o.timeout);
    } catch (const std::exception& e) {
      throw TimeoutError(ErrorContext{-1, -1, "tcp_store.connect", -1},
                         fmt::format("no store server at {}:{} within {} ms: {}", o.host, o.port,
                                     o.timeout.count(), e.what()));
    }
    request("tcp_store.connect", fmt::format("handshake with {}:{}", o.host, o.port),
            proto::encode_hello(o.token));
    network_address_ = net::local_address(socket_.fd());
    // The master's name resolved to loopback here (e.g. a hostname mapped to 127.0.1.1 in
    // /etc/hosts) although it is not a loopback name: peers on other hosts cannot reach a
    // loopback address, so offer this host's first external address instead.
    if (net::is_loopback_host(network_address_) && !net::is_loopback_host(o.host)) {
      const std::string external = net::first_external_address();
      if (!external.empty()) network_address_ = external;
    }
  }

  std::string network_address() const override { return network_address_; }

  void set(const std::string& key, const Bytes& value) override {
    check_bounds("store.set", "set", key, proto::check_value("set", value.size(), limits_));
    request("store.set", at(key),
            proto::encode_set(
                key, std::string_view(reinterpret_cast<const char*>(value.data()), value.size())));
  }

  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    check_bounds("store.get", "get", key);
    wait({key}, timeout);
    const std::string r = request("store.get", at(key), proto::encode_get(key));
    if (r.empty() || r[0] != 1) {
      throw CommError(ErrorContext{-1, -1, "store.get", -1}, fmt::format("key '{}' vanished", key));
    }
    return Bytes(r.begin() + 1, r.end());
  }

  int64_t add(const std::string& key, int64_t delta) override {
    check_bounds("store.add", "add", key);
    const std::string r = request("store.add", at(key), proto::encode_add(key, delta));
    if (r.size() != 8) {
      std::lock_guard<std::mutex> lock(mu_);
      broken_ = fmt::format("{}: malformed reply to add ({} bytes)", at(key), r.size());
      throw CommError(ErrorContext{-1, -1, "store.add", -1}, broken_);
    }
    return proto::read_i64(r.data());
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    auto backoff = std::chrono::milliseconds(1);
    while (!check(keys)) {
      if (Clock::now() >= deadline) {
        throw TimeoutError(
            ErrorContext{-1, -1, "store.wait", -1},
            fmt::format("key '{}'{} not set within {} ms", keys.empty() ? "" : keys.front(),
                        keys.size() > 1 ? " (or another)" : "", timeout.count()));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
    }
  }

  bool check(const std::vector<std::string>& keys) override {
    const std::string first = keys.empty() ? "" : keys.front();
    for (const auto& k : keys) check_bounds("store.check", "check", k);
    std::string frame = proto::encode_check(keys);
    if (frame.size() - 4 > limits_.max_frame_bytes()) {
      throw InvalidArgument(ErrorContext{-1, -1, "store.check", -1},
                            fmt::format("{} keys make a request of {} bytes, over the bound of {}",
                                        keys.size(), frame.size() - 4, limits_.max_frame_bytes()));
    }
    const std::string r = request("store.check", at(first), frame);
    return r.size() == 1 && r[0] == 1;
  }

 private:
  // The server checks too; checking here names the caller's mistake without a round trip.
  void check_bounds(const char* op, const char* verb, const std::string& key,
                    std::string value_error = {}) const {
    std::string e = proto::check_key(verb, key, limits_);
    if (e.empty()) e = std::move(value_error);
    if (!e.empty()) throw InvalidArgument(ErrorContext{-1, -1, op, -1}, e);
  }

  std::string at(const std::string& key) const {
    return fmt::format("key '{}' at {}:{}", key, options_.host, options_.port);
  }

  // Sends one request frame and returns the ok reply's payload. A failed exchange leaves the
  // connection out of step (a late reply would answer the next request): it breaks the store.
  // `where` names the key and server for messages.
  std::string request(const char* op, const std::string& where, const std::string& frame) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) {
      throw CommError(ErrorContext{-1, -1, op, -1},
                      fmt::format("store connection broken by an earlier failure: {}", broken_));
    }
    const auto deadline = Clock::now() + options_.timeout;
    std::string reply;
    try {
      detail::send_all(socket_.fd(), frame.data(), frame.size(), deadline);
      char len_buf[4];
      detail::recv_all(socket_.fd(), len_buf, 4, deadline);
      const uint32_t len = proto::read_u32(len_buf);
      if (len == 0 || len > limits_.max_frame_bytes()) {
        throw std::runtime_error(fmt::format("corrupt reply (length {})", len));
      }
      reply.resize(len);
      detail::recv_all(socket_.fd(), reply.data(), len, deadline);
    } catch (const std::exception& e) {
      const std::string msg = fmt::format("{}: {}", where, e.what());
      broken_ = msg;
      if (std::strstr(e.what(), "timed out")) throw TimeoutError(ErrorContext{-1, -1, op, -1}, msg);
      throw CommError(ErrorContext{-1, -1, op, -1}, msg);
    }
    const std::string message = reply.substr(1);
    switch (static_cast<uint8_t>(reply[0])) {
      case proto::kOk:
        return message;
      case proto::kBadRequest:
        throw InvalidArgument(ErrorContext{-1, -1, op, -1}, fmt::format("{}: {}", where, message));
      case proto::kRefused:
        broken_ = fmt::format("store at {}:{} refused this process: {}", options_.host,
                              options_.port, message);
        throw CommError(ErrorContext{-1, -1, op, -1}, broken_);
      default:
        broken_ = fmt::format("{}: reply with unknown status {}", where,
                              static_cast<int>(static_cast<uint8_t>(reply[0])));
        throw CommError(ErrorContext{-1, -1, op, -1}, broken_);
    }
  }

  TcpStoreOptions options_;
  proto::Limits limits_;
  std::unique_ptr<detail::StoreServer> server_;  // destroyed after the client socket below
  std::mutex mu_;
  Socket socket_;
  std::string broken_;  // why the connection can no longer be used; empty while it can
  std::string network_address_;
};

}  // namespace

std::shared_ptr<Store> make_tcp_store(const TcpStoreOptions& o) {
  const auto fail = [](const std::string& why) {
    throw InvalidArgument(ErrorContext{-1, -1, "make_tcp_store", -1}, why);
  };
  if (o.host.empty()) fail("empty host");
  if (o.timeout.count() <= 0) fail("timeout must be > 0");
  if (o.token.size() > proto::kMaxTokenBytes) {
    fail(fmt::format("token (DTRAIN_STORE_TOKEN) of {} bytes; at most {}", o.token.size(),
                     proto::kMaxTokenBytes));
  }
  if (o.max_key_bytes == 0 || o.max_value_bytes == 0 ||
      uint64_t{o.max_key_bytes} + o.max_value_bytes > (1u << 30)) {
    fail("max_key_bytes and max_value_bytes must be > 0 and sum to at most 1 GiB");
  }
  if (o.is_server) {
    if (o.max_clients < 1) fail("max_clients must be >= 1");
    if (o.max_unread_reply_bytes < size_t{o.max_value_bytes} + 16) {
      fail(
          fmt::format("max_unread_reply_bytes={} is below one reply to a get "
                      "(max_value_bytes + 16 = {})",
                      o.max_unread_reply_bytes, size_t{o.max_value_bytes} + 16));
    }
    if (o.handshake_timeout.count() <= 0) fail("handshake_timeout must be > 0");
  }
  return std::make_shared<TcpStore>(o);
}

}  // namespace dtrain

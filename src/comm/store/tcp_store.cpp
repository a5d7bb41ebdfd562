// dtrain's own TCP store: one server thread (on rank 0) holding a key-value map, and a
// client per process. Waiting is done by the client, polling check() with backoff, so the
// server never holds per-waiter state and a dead client costs it nothing.
//
// Why not c10d::TCPStore: its C++ API and options differ between LibTorch 1.13 and 2.x and
// it is not part of LibTorch's stable frontend; Gloo's snapshot has no TCP store. This one
// is small, independent of the LibTorch version, and tested here.
//
// Wire format (little-endian, same-architecture peers): request = u32 length, u8 command,
// payload; reply = u32 length, payload.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "comm/net/address.h"
#include "comm/store/socket.h"
#include "dtrain/errors.h"
#include "dtrain/store.h"

namespace dtrain {
namespace {

using detail::Clock;
using detail::Socket;

enum Command : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4 };
constexpr uint32_t kMaxFrame = 1u << 30;

void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void put_i64(std::string& s, int64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
uint32_t get_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
int64_t get_i64(const char* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// The server: a map and a poll loop. Lives on the rank-0 process.
class StoreServer {
 public:
  StoreServer(const std::string& host, uint16_t port) {
    listener_ = detail::listen_tcp(bind_address(host), port);
    if (::pipe2(wake_, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    thread_ = std::thread([this] { loop(); });
  }
  ~StoreServer() {
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
    thread_.join();
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

 private:
  // The master's address, so that only the network peers use can reach the store. When a
  // non-loopback name resolves to loopback here (a hostname mapped to 127.0.1.1 in
  // /etc/hosts), peers elsewhere reach this host by another address: every interface then.
  static std::string bind_address(const std::string& host) {
    if (host == "localhost") return "127.0.0.1";
    if (net::is_loopback_host(host)) return host;
    const std::string resolved = net::resolve_numeric(host);
    return net::is_loopback_host(resolved) ? std::string() : host;
  }

  struct Client {
    Socket socket;
    std::string in;
  };

  void loop() {
    for (;;) {
      std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listener_.fd(), POLLIN, 0}};
      for (auto& c : clients_) fds.push_back({c.socket.fd(), POLLIN, 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) {
        int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) clients_.push_back(Client{Socket(fd), {}});
      }
      // Serve existing clients; indices shift when one is dropped, so walk backwards.
      for (size_t i = fds.size(); i-- > 2;) {
        if (fds[i].revents == 0) continue;
        size_t ci = i - 2;
        if (!serve(clients_[ci])) clients_.erase(clients_.begin() + static_cast<long>(ci));
      }
    }
  }

  // Reads what is available and answers complete requests. False: drop the client.
  bool serve(Client& c) {
    char buf[65536];
    ssize_t k = ::recv(c.socket.fd(), buf, sizeof(buf), MSG_DONTWAIT);
    if (k == 0) return false;
    if (k < 0) return errno == EAGAIN || errno == EINTR;
    c.in.append(buf, static_cast<size_t>(k));
    while (c.in.size() >= 4) {
      uint32_t len = get_u32(c.in.data());
      if (len == 0 || len > kMaxFrame) return false;
      if (c.in.size() < 4 + len) break;
      std::string reply;
      if (!handle(c.in.data() + 4, len, reply)) return false;
      std::string frame;
      put_u32(frame, static_cast<uint32_t>(reply.size()));
      frame += reply;
      try {
        detail::send_all(c.socket.fd(), frame.data(), frame.size(),
                         Clock::now() + std::chrono::seconds(30));
      } catch (const std::exception&) {
        return false;
      }
      c.in.erase(0, 4 + len);
    }
    return true;
  }

  bool handle(const char* p, uint32_t len, std::string& reply) {
    const uint8_t cmd = static_cast<uint8_t>(p[0]);
    const char* q = p + 1;
    const char* end = p + len;
    switch (cmd) {
      case kSet: {
        if (end - q < 4) return false;
        uint32_t klen = get_u32(q);
        q += 4;
        if (static_cast<uint32_t>(end - q) < klen) return false;
        data_[std::string(q, klen)] = Bytes(q + klen, end);
        return true;
      }
      case kGet: {
        auto it = data_.find(std::string(q, end));
        reply.push_back(it != data_.end() ? 1 : 0);
        if (it != data_.end()) reply.append(it->second.begin(), it->second.end());
        return true;
      }
      case kAdd: {
        if (end - q < 8) return false;
        int64_t delta = get_i64(q);
        Bytes& v = data_[std::string(q + 8, end)];
        int64_t x = v.empty() ? 0 : std::stoll(std::string(v.begin(), v.end()));
        x += delta;
        std::string s = std::to_string(x);
        v.assign(s.begin(), s.end());
        put_i64(reply, x);
        return true;
      }
      case kCheck: {
        if (end - q < 4) return false;
        uint32_t n = get_u32(q);
        q += 4;
        bool all = true;
        for (uint32_t i = 0; i < n; ++i) {
          if (end - q < 4) return false;
          uint32_t klen = get_u32(q);
          q += 4;
          if (static_cast<uint32_t>(end - q) < klen) return false;
          all = all && data_.count(std::string(q, klen)) > 0;
          q += klen;
        }
        reply.push_back(all ? 1 : 0);
        return true;
      }
      default:
        return false;
    }
  }

  Socket listener_;
  int wake_[2] = {-1, -1};
  std::vector<Client> clients_;
  std::map<std::string, Bytes> data_;
  std::thread thread_;
};

class TcpStore final : public Store {
 public:
  explicit TcpStore(const TcpStoreOptions& o) : options_(o) {
    try {
      if (o.is_server) server_ = std::make_unique<StoreServer>(o.host, o.port);
    } catch (const std::system_error& e) {
      const ErrorContext ctx{-1, -1, "tcp_store.listen", -1};
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
      throw CommError(ErrorContext{-1, -1, "tcp_store.listen", -1},
                      fmt::format("{}:{}: {}", o.host, o.port, e.what()));
    }
    try {
      socket_ = detail::connect_tcp(o.host, o.port, Clock::now() + o.timeout);
    } catch (const std::exception& e) {
      throw TimeoutError(ErrorContext{-1, -1, "tcp_store.connect", -1},
                         fmt::format("no store server at {}:{} within {} ms: {}", o.host, o.port,
                                     o.timeout.count(), e.what()));
    }
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
    std::string req;
    put_u32(req, static_cast<uint32_t>(key.size()));
    req += key;
    req.append(value.begin(), value.end());
    request("store.set", key, kSet, req);
  }

  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    std::string r = request("store.get", key, kGet, key);
    if (r.empty() || r[0] != 1) {
      throw CommError(ErrorContext{-1, -1, "store.get", -1}, fmt::format("key '{}' vanished", key));
    }
    return Bytes(r.begin() + 1, r.end());
  }

  int64_t add(const std::string& key, int64_t delta) override {
    std::string req;
    put_i64(req, delta);
    req += key;
    std::string r = request("store.add", key, kAdd, req);
    return get_i64(r.data());
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
    std::string req;
    put_u32(req, static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) {
      put_u32(req, static_cast<uint32_t>(k.size()));
      req += k;
    }
    std::string r = request("store.check", keys.empty() ? "" : keys.front(), kCheck, req);
    return !r.empty() && r[0] == 1;
  }

 private:
  std::string request(const char* op, const std::string& key, Command cmd,
                      const std::string& payload) {
    std::string frame;
    put_u32(frame, static_cast<uint32_t>(payload.size() + 1));
    frame.push_back(static_cast<char>(cmd));
    frame += payload;
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Clock::now() + options_.timeout;
    try {
      detail::send_all(socket_.fd(), frame.data(), frame.size(), deadline);
      char len_buf[4];
      detail::recv_all(socket_.fd(), len_buf, 4, deadline);
      uint32_t len = get_u32(len_buf);
      if (len > kMaxFrame) throw std::runtime_error("corrupt reply");
      std::string reply(len, '\0');
      detail::recv_all(socket_.fd(), reply.data(), len, deadline);
      return reply;
    } catch (const std::exception& e) {
      std::string msg =
          fmt::format("key '{}' at {}:{}: {}", key, options_.host, options_.port, e.what());
      if (std::strstr(e.what(), "timed out")) throw TimeoutError(ErrorContext{-1, -1, op, -1}, msg);
      throw CommError(ErrorContext{-1, -1, op, -1}, msg);
    }
  }

  TcpStoreOptions options_;
  std::unique_ptr<StoreServer> server_;  // destroyed after the client socket below
  std::mutex mu_;
  Socket socket_;
  std::string network_address_;
};

}  // namespace

std::shared_ptr<Store> make_tcp_store(const TcpStoreOptions& options) {
  if (options.host.empty()) throw InvalidArgument("make_tcp_store: empty host");
  if (options.timeout.count() <= 0) throw InvalidArgument("make_tcp_store: timeout must be > 0");
  return std::make_shared<TcpStore>(options);
}

}  // namespace dtrain

#include "comm/store/store_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "comm/net/address.h"
#include "comm/store/protocol.h"

namespace dtrain::detail {
namespace proto = store_protocol;

void AcceptBackoff::failed(int err, Clock::time_point now) {
  // Errors of one connection (it was reset, a firewall said no): the next may succeed.
  if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED || err == EPROTO ||
      err == EPERM) {
    return;
  }
  delay_ = delay_ == Clock::duration::zero() ? Clock::duration(kMin)
                                             : std::min<Clock::duration>(delay_ * 2, kMax);
  resume_ = now + delay_;
}

namespace {

// How long a refused or misbehaving client may still read its error reply before it is cut.
constexpr std::chrono::seconds kLinger{2};
// Connections kept only to deliver a refusal; beyond this a flood is closed without a word.
constexpr size_t kMaxLingering = 64;
constexpr int kAcceptsPerWakeup = 64;

// The master's address, so that only the network peers use can reach the store. When a
// non-loopback name resolves to loopback here (a hostname mapped to 127.0.1.1 in
// /etc/hosts), peers elsewhere reach this host by another address: every interface then.
std::string bind_address(const std::string& host) {
  if (host == "localhost") return "127.0.0.1";
  if (net::is_loopback_host(host)) return host;
  const std::string resolved = net::resolve_numeric(host);
  return net::is_loopback_host(resolved) ? std::string() : host;
}

int poll_timeout_ms(Clock::time_point now, Clock::time_point next) {
  if (next == Clock::time_point::max()) return -1;
  if (next <= now) return 0;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(next - now).count();
  return static_cast<int>(std::min<int64_t>((us + 999) / 1000, 1 << 30));
}

}  // namespace

struct StoreServer::Impl {
  enum class State { kHandshake, kReady, kLingering };

  struct Connection {
    Socket socket;
    State state = State::kHandshake;
    Clock::time_point deadline;  // of the handshake, or of lingering
    proto::Session session;
    std::string out;  // replies; out[sent..] not yet written
    size_t sent = 0;
    bool shut = false;  // our side shut down after the last reply
    bool dead = false;
  };

  TcpStoreOptions options;
  proto::Server protocol;
  Socket listener;
  int wake[2] = {-1, -1};
  AcceptBackoff backoff;
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  std::vector<char> buffer = std::vector<char>(64 * 1024);
  size_t active = 0;  // handshaking or ready
  size_t lingering = 0;

  explicit Impl(const TcpStoreOptions& o)
      : options(o),
        protocol(proto::Limits{o.max_key_bytes, o.max_value_bytes, o.max_unread_reply_bytes},
                 o.token) {
    listener = listen_tcp(bind_address(o.host), o.port);
    const int flags = ::fcntl(listener.fd(), F_GETFL);
    ::fcntl(listener.fd(), F_SETFL, flags | O_NONBLOCK);
    if (::pipe2(wake, O_CLOEXEC) != 0) {
      throw std::system_error(errno, std::generic_category(), "pipe2");
    }
  }

  ~Impl() {
    if (wake[0] >= 0) ::close(wake[0]);
    if (wake[1] >= 0) ::close(wake[1]);
  }

  void run() {
    for (;;) {
      try {
        if (!step()) return;
      } catch (const std::exception&) {
        // Out of memory outside a client's request: keep the store alive, without spinning.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }

  // One poll round. False when the owner asked the thread to end.
  bool step() {
    const Clock::time_point now = Clock::now();
    const bool listening = !backoff.paused(now);
    Clock::time_point next = listening ? Clock::time_point::max() : backoff.resume_at();
    fds.clear();
    fds.push_back({wake[0], POLLIN, 0});
    fds.push_back({listening ? listener.fd() : -1, POLLIN, 0});  // fd -1: not polled
    for (const auto& c : conns) {
      const short events = static_cast<short>(POLLIN | (c.sent < c.out.size() ? POLLOUT : 0));
      fds.push_back({c.socket.fd(), events, 0});
      if (c.state != State::kReady) next = std::min(next, c.deadline);
    }
    if (::poll(fds.data(), fds.size(), poll_timeout_ms(now, next)) < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return true;
    }
    if (fds[0].revents != 0) return false;
    const size_t polled = conns.size();
    const Clock::time_point after = Clock::now();
    for (size_t i = 0; i < polled; ++i) {
      if (fds[i + 2].revents != 0) serve(conns[i], fds[i + 2].revents, after);
      if (conns[i].state != State::kReady && after >= conns[i].deadline) conns[i].dead = true;
    }
    if (listening && fds[1].revents != 0) {
      // Count after serving: a slot freed in this round is free for a client accepted now.
      active = lingering = 0;
      for (const auto& c : conns) {
        if (!c.dead) (c.state == State::kLingering ? lingering : active) += 1;
      }
      accept_all(after);
    }
    conns.erase(
        std::remove_if(conns.begin(), conns.end(), [](const Connection& c) { return c.dead; }),
        conns.end());
    return true;
  }

  void accept_all(Clock::time_point now) {
    for (int i = 0; i < kAcceptsPerWakeup; ++i) {
      const int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        backoff.failed(errno, now);
        if (backoff.paused(now)) return;
        continue;
      }
      backoff.succeeded();
      admit(Socket(fd), now);
    }
  }

  void admit(Socket s, Clock::time_point now) {
    int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Connection c;
    c.socket = std::move(s);
    if (active >= static_cast<size_t>(options.max_clients)) {
      if (lingering >= kMaxLingering) return;  // closes the socket
      proto::put_reply(c.out, proto::kRefused,
                       fmt::format("too many clients (max_clients={})", options.max_clients));
      linger(c, now);
    } else {
      c.deadline = now + options.handshake_timeout;
      ++active;
    }
    conns.push_back(std::move(c));
  }

  void linger(Connection& c, Clock::time_point now) {
    if (c.state != State::kLingering) ++lingering;
    c.state = State::kLingering;
    c.deadline = now + kLinger;
  }

  void serve(Connection& c, short revents, Clock::time_point now) {
    if (revents & POLLNVAL) {
      c.dead = true;
      return;
    }
    if (revents & (POLLIN | POLLHUP | POLLERR)) receive(c, now);
    if (!c.dead) flush(c);
  }

  // One read per wakeup, so that a client sending without pause cannot starve the others.
  void receive(Connection& c, Clock::time_point now) {
    const ssize_t k = ::recv(c.socket.fd(), buffer.data(), buffer.size(), MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      c.dead = true;
      return;
    }
    if (k < 0 || c.state == State::kLingering) return;  // lingering: input is discarded
    c.out.erase(0, c.sent);
    c.sent = 0;
    proto::Verdict v;
    try {
      v = protocol.consume(c.session, buffer.data(), static_cast<size_t>(k), c.out);
    } catch (const std::exception&) {
      c.dead = true;  // std::bad_alloc on this client's request
      return;
    }
    if (c.out.size() > options.max_unread_reply_bytes) {
      c.dead = true;  // it does not read its replies
    } else if (v == proto::Verdict::kClose) {
      linger(c, now);
    } else if (c.state == State::kHandshake && c.session.greeted) {
      c.state = State::kReady;
    }
  }

  void flush(Connection& c) {
    while (c.sent < c.out.size()) {
      const ssize_t k = ::send(c.socket.fd(), c.out.data() + c.sent, c.out.size() - c.sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        c.sent += static_cast<size_t>(k);
      } else if (k < 0 && errno == EINTR) {
        continue;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;
      } else {
        c.dead = true;
        return;
      }
    }
    c.out.clear();
    c.sent = 0;
    // A refused client reads its reply, then end of stream. The socket stays open until the
    // client closes (or the linger ends): closing with its unread request would reset the
    // connection and could destroy the reply before the client reads it.
    if (c.state == State::kLingering && !c.shut) {
      ::shutdown(c.socket.fd(), SHUT_WR);
      c.shut = true;
    }
  }
};

StoreServer::StoreServer(const TcpStoreOptions& options) : impl_(std::make_unique<Impl>(options)) {
  thread_ = std::thread([impl = impl_.get()] { impl->run(); });
  pthread_setname_np(thread_.native_handle(), "dtrain-store");
}

StoreServer::~StoreServer() {
  const char c = 0;
  (void)!::write(impl_->wake[1], &c, 1);
  thread_.join();
}

}  // namespace dtrain::detail

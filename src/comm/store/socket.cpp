#include "comm/store/socket.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <thread>

namespace dtrain::detail {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

struct AddrInfo {
  addrinfo* head = nullptr;
  ~AddrInfo() {
    if (head) freeaddrinfo(head);
  }
};

void resolve(const std::string& host, uint16_t port, bool passive, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
  if (rc != 0) throw std::runtime_error("cannot resolve '" + host + "': " + gai_strerror(rc));
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

void wait_ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = remaining_ms(deadline);
    int rc = ::poll(&p, 1, ms);
    if (rc > 0) return;
    if (rc == 0) throw std::runtime_error("timed out");
    if (errno != EINTR) throw_errno("poll");
  }
}

bool is_self_connected(int fd) {
  sockaddr_storage a{}, b{};
  socklen_t la = sizeof(a), lb = sizeof(b);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0) return false;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0) return false;
  return la == lb && std::memcmp(&a, &b, la) == 0;
}

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Socket listen_tcp(const std::string& host, uint16_t port, uint16_t* bound_port) {
  AddrInfo ai;
  resolve(host, port, true, ai);
  int last_errno = EADDRNOTAVAIL;
  for (addrinfo* a = ai.head; a != nullptr; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (s.fd() < 0) continue;
    int one = 1;
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd(), 1024) != 0) {
      last_errno = errno;
      continue;
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr), &len);
    if (bound_port) {
      *bound_port =
          ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    }
    return s;
  }
  throw std::system_error(last_errno, std::generic_category(),
                          "cannot listen on " + host + ":" + std::to_string(port));
}

Socket connect_tcp(const std::string& host, uint16_t port, Clock::time_point deadline) {
  std::string last_error = "no address";
  auto backoff = std::chrono::milliseconds(5);
  do {
    AddrInfo ai;
    resolve(host, port, false, ai);
    for (addrinfo* a = ai.head; a != nullptr; a = a->ai_next) {
      Socket s(
          ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
      if (s.fd() < 0) continue;
      // Non-blocking, so that an address that drops SYNs costs at most the deadline
      // (a blocking connect waits for the kernel's SYN retries, about two minutes).
      int rc = ::connect(s.fd(), a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{s.fd(), POLLOUT, 0};
        int ready;
        do {
          ready = ::poll(&p, 1, remaining_ms(deadline));
        } while (ready < 0 && errno == EINTR);
        int err = ETIMEDOUT;
        socklen_t len = sizeof(err);
        if (ready > 0) getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc == 0) {
        // Connecting to a local port in the ephemeral range before anyone listens can
        // connect the socket to itself; treat that like a refusal.
        if (is_self_connected(s.fd())) {
          last_error = "self-connect";
          continue;
        }
        int one = 1;
        setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return s;
      }
      last_error = std::strerror(errno);
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(
        backoff, std::max<Clock::duration>(deadline - Clock::now(), Clock::duration::zero())));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  } while (Clock::now() < deadline);
  throw std::runtime_error("timed out connecting to " + host + ":" + std::to_string(port) + " (" +
                           last_error + ")");
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_ready(fd, POLLOUT, deadline);
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else {
      throw_errno("send");
    }
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k == 0) {
      throw std::runtime_error("connection closed by the store server");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_ready(fd, POLLIN, deadline);
    } else if (errno != EINTR) {
      throw_errno("recv");
    }
  }
}

}  // namespace dtrain::detail

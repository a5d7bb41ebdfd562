// Minimal blocking TCP helpers with deadlines, for the TCP store.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::detail {

using Clock = std::chrono::steady_clock;

// Owns a socket file descriptor.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.release()) {}
  Socket& operator=(Socket&& o) noexcept;
  ~Socket();
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_ = -1;
};

// Listens on host:port (port 0: any; host "": every interface); returns the socket and the
// bound port. Throws std::system_error carrying bind's errno.
Socket listen_tcp(const std::string& host, uint16_t port, uint16_t* bound_port = nullptr);

// Connects to host:port, retrying refused or unreachable connections until the deadline
// (each attempt is bounded by it too, so a black-holed address cannot block longer). Throws
// std::system_error / std::runtime_error on failure; the caller adds context.
Socket connect_tcp(const std::string& host, uint16_t port, Clock::time_point deadline);

// Sends or receives exactly n bytes before the deadline, else throws (runtime_error with
// "timed out" in the message on expiry, "closed" when the peer closed).
void send_all(int fd, const void* data, size_t n, Clock::time_point deadline);
void recv_all(int fd, void* data, size_t n, Clock::time_point deadline);

}  // namespace dtrain::detail

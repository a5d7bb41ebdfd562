// The TCP store's server: one thread polling non-blocking sockets, running the protocol of
// store_protocol::Server for each client. Lives in the rank-0 process.
#pragma once

#include <memory>
#include <thread>

#include "comm/store/socket.h"
#include "dtrain/store.h"

namespace dtrain::detail {

// When accept() keeps failing (no file descriptor or memory left), the listener stays
// readable and polling it again at once would spin a core: pause it, 10 ms doubling to 1 s,
// and start over after an accept succeeds.
class AcceptBackoff {
 public:
  static constexpr std::chrono::milliseconds kMin{10};
  static constexpr std::chrono::milliseconds kMax{1000};

  // Records a failed accept (errno `err`); transient per-connection errors do not pause.
  void failed(int err, Clock::time_point now);
  void succeeded() { delay_ = Clock::duration::zero(); }
  bool paused(Clock::time_point now) const { return now < resume_; }
  Clock::time_point resume_at() const { return resume_; }
  Clock::duration delay() const { return delay_; }

 private:
  Clock::duration delay_ = Clock::duration::zero();
  Clock::time_point resume_{};
};

class StoreServer {
 public:
  // Listens on options.host:options.port (by the listening-address rule) and starts serving.
  // Throws std::system_error carrying bind's errno.
  explicit StoreServer(const TcpStoreOptions& options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
};

}  // namespace dtrain::detail

// Work for backends that complete calls on a host thread (Gloo, MPI), and the FIFO worker
// that runs those calls off the caller's thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain::detail {

class CpuWork final : public Work {
 public:
  CpuWork(uint64_t seq, std::string op, ErrorContext context, std::chrono::milliseconds timeout,
          std::vector<at::Tensor> keep_alive);
  // `drive` moves calls on where only the caller's thread may (MPI below
  // MPI_THREAD_MULTIPLE): wait() calls it until the call completes, is_completed() once. It
  // must not block, nor call back into this Work.
  CpuWork(uint64_t seq, std::string op, ErrorContext context, std::chrono::milliseconds timeout,
          std::vector<at::Tensor> keep_alive, std::function<void()> drive);

  bool is_completed() const override;
  void wait(std::chrono::milliseconds timeout = kDefaultTimeout) override;
  std::exception_ptr exception() const override;
  uint64_t sequence_number() const override { return seq_; }
  const std::string& op_name() const override { return op_; }

  // Called once by the thread that ran the call.
  void finish(std::exception_ptr error = nullptr);

 private:
  const uint64_t seq_;
  const std::string op_;
  const ErrorContext context_;
  const std::chrono::milliseconds default_timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<at::Tensor> keep_alive_;
  const std::function<void()> drive_;
};

// Runs submitted tasks one at a time, in submission order, on its own thread. The
// destructor runs what is still queued, then joins. Tasks report their failures through
// their Work; whatever escapes a task anyway is dropped, never left to terminate.
class SerialExecutor {
 public:
  SerialExecutor();
  ~SerialExecutor();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void submit(std::function<void()> task);

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dtrain::detail

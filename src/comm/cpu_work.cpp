#include "comm/cpu_work.h"

#include <fmt/format.h>

namespace dtrain::detail {

CpuWork::CpuWork(uint64_t seq, std::string op, ErrorContext context,
                 std::chrono::milliseconds timeout, std::vector<at::Tensor> keep_alive)
    : seq_(seq),
      op_(std::move(op)),
      context_(std::move(context)),
      default_timeout_(timeout),
      keep_alive_(std::move(keep_alive)) {}

CpuWork::CpuWork(uint64_t seq, std::string op, ErrorContext context,
                 std::chrono::milliseconds timeout, std::vector<at::Tensor> keep_alive,
                 std::function<void()> drive)
    : seq_(seq),
      op_(std::move(op)),
      context_(std::move(context)),
      default_timeout_(timeout),
      keep_alive_(std::move(keep_alive)),
      drive_(std::move(drive)) {}

bool CpuWork::is_completed() const {
  if (drive_) drive_();
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void CpuWork::wait(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) timeout = default_timeout_;
  std::unique_lock<std::mutex> lock(mu_);
  if (drive_) {
    // The call moves on only while this thread drives it.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!done_ && std::chrono::steady_clock::now() < deadline) {
      lock.unlock();
      drive_();
      std::this_thread::yield();
      lock.lock();
    }
  }
  if (!cv_.wait_for(lock, drive_ ? std::chrono::milliseconds(0) : timeout, [&] { return done_; })) {
    throw TimeoutError(context_,
                       fmt::format("Work::wait: not completed within {} ms", timeout.count()));
  }
  if (error_) std::rethrow_exception(error_);
}

std::exception_ptr CpuWork::exception() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void CpuWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    done_ = true;
    keep_alive_.clear();
  }
  cv_.notify_all();
}

SerialExecutor::SerialExecutor() : thread_([this] { loop(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void SerialExecutor::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SerialExecutor::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      task();
    } catch (...) {
      // Tasks report failures through their own Work; an exception escaping one (out of
      // memory while failing it) must not terminate the process from this thread.
    }
  }
}

}  // namespace dtrain::detail

#include <atomic>
#include <mutex>

#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain {
namespace {

// The continuation runs in wait(), under run_mu_. is_completed() and exception() only read
// `done_` (and `error_`, written before `done_` is set and never after), so they never wait
// for a continuation another thread is running.
class ThenWork final : public Work {
 public:
  ThenWork(WorkPtr inner, std::function<void()> continuation)
      : inner_(std::move(inner)), continuation_(std::move(continuation)) {}

  bool is_completed() const override {
    if (done_.load(std::memory_order_acquire)) return true;
    // A failed inner work completes this one: the continuation never runs.
    return inner_->is_completed() && inner_->exception() != nullptr;
  }

  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);  // rethrows the inner failure
    run_continuation();
    if (error_) std::rethrow_exception(error_);
  }

  std::exception_ptr exception() const override {
    if (auto e = inner_->exception()) return e;
    return done_.load(std::memory_order_acquire) ? error_ : nullptr;
  }

  uint64_t sequence_number() const override { return inner_->sequence_number(); }
  const std::string& op_name() const override { return inner_->op_name(); }

 private:
  // Once, on the first thread that gets here; later ones wait for it to finish.
  void run_continuation() {
    std::lock_guard<std::mutex> lock(run_mu_);
    if (done_.load(std::memory_order_relaxed)) return;
    try {
      continuation_();
    } catch (...) {
      error_ = std::current_exception();
    }
    continuation_ = nullptr;  // release what it captured
    done_.store(true, std::memory_order_release);
  }

  WorkPtr inner_;
  std::function<void()> continuation_;
  std::mutex run_mu_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

}  // namespace

WorkPtr then(WorkPtr work, std::function<void()> continuation) {
  if (!work) throw InvalidArgument("then: work is null");
  return std::make_shared<ThenWork>(std::move(work), std::move(continuation));
}

}  // namespace dtrain

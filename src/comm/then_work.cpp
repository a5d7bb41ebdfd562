#include <mutex>

#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain {
namespace {

class ThenWork final : public Work {
 public:
  ThenWork(WorkPtr inner, std::function<void()> continuation)
      : inner_(std::move(inner)), continuation_(std::move(continuation)) {}

  bool is_completed() const override {
    if (!inner_->is_completed()) return false;
    const_cast<ThenWork*>(this)->run_continuation();
    return true;
  }

  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    run_continuation();
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
  }

  std::exception_ptr exception() const override {
    if (auto e = inner_->exception()) return e;
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  uint64_t sequence_number() const override { return inner_->sequence_number(); }
  const std::string& op_name() const override { return inner_->op_name(); }

 private:
  void run_continuation() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ran_ || inner_->exception()) return;
    ran_ = true;
    try {
      continuation_();
    } catch (...) {
      error_ = std::current_exception();
    }
    continuation_ = nullptr;  // release what it captured
  }

  WorkPtr inner_;
  std::function<void()> continuation_;
  mutable std::mutex mu_;
  bool ran_ = false;
  std::exception_ptr error_;
};

}  // namespace

WorkPtr then(WorkPtr work, std::function<void()> continuation) {
  if (!work) throw InvalidArgument("then: work is null");
  return std::make_shared<ThenWork>(std::move(work), std::move(continuation));
}

}  // namespace dtrain

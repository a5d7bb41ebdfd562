// The one failure state of a strategy, owned by its StepDriver (strategy/step_driver.h) and
// shared with the parts that see failures first: the step agreements (StepSync), DDP's
// reducer and FSDP's schedule, whose gradient hooks run on autograd's threads.
//
//   kHealthy --out_of_step()--> kOutOfStep --break_with()--> kBroken
//       \______________________ break_with() _______________/
//
// kOutOfStep: this rank's collectives may no longer match its peers' (a comm hook threw while
// issuing, a collective or a unit transition failed); it is set where that is seen, often
// inside autograd where nothing may throw, and the driver breaks at its next check. kBroken is
// sticky: every later call throws the first cause, and the strategy issues nothing more, so
// its peers fail within their communicator's timeout instead of pairing the wrong collectives.
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>

#include "dtrain/errors.h"

namespace dtrain {

class StepFailure {
 public:
  enum class State { kHealthy, kOutOfStep, kBroken };

  // `strategy` names it in messages ("FullyShardedDataParallel").
  StepFailure(std::string strategy, int rank, int world_size)
      : strategy_(std::move(strategy)), rank_(rank), world_size_(world_size) {}
  StepFailure(const StepFailure&) = delete;
  StepFailure& operator=(const StepFailure&) = delete;

  State state() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_;
  }
  bool broken() const { return state() == State::kBroken; }

  // From any thread; `cause` may be null (then the break names the first cause given later).
  void out_of_step(std::exception_ptr cause) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::kHealthy) return;
    state_ = State::kOutOfStep;
    out_of_step_cause_ = std::move(cause);
  }
  // What out_of_step() was given (null when none or not out of step).
  std::exception_ptr out_of_step_cause() const {
    std::lock_guard<std::mutex> lock(mu_);
    return out_of_step_cause_;
  }

  // Throws the sticky CommError when broken.
  void check_usable() const {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      e = broken_;
    }
    if (e) std::rethrow_exception(e);
  }

  // Breaks (once) and returns the CommError to throw: "<strategy> is unusable since step
  // <step>: <why>: <cause>". `step` is the step the break happens in.
  std::exception_ptr break_with(const char* op, int64_t step, const std::string& why,
                                std::exception_ptr cause);

 private:
  const std::string strategy_;
  const int rank_, world_size_;
  mutable std::mutex mu_;
  State state_ = State::kHealthy;
  std::exception_ptr out_of_step_cause_;
  std::exception_ptr broken_;
};

// what() of an exception_ptr, for messages ("unknown exception" for non-std exceptions).
std::string describe(std::exception_ptr e);

}  // namespace dtrain

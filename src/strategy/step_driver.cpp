#include "strategy/step_driver.h"

#include <c10/core/GradMode.h>

#include <utility>

namespace dtrain {

void break_step(std::string why) { throw StepBreak{std::move(why), std::current_exception()}; }

StepDriver::StepDriver(std::string strategy, CommunicatorPtr comm, StepChecks checks,
                       std::vector<CommunicatorPtr> wire_comms, StepParticipant& participant)
    : participant_(participant),
      failure_(strategy, comm ? comm->rank() : 0, comm ? comm->world_size() : 1),
      steps_(comm, std::move(strategy), failure_, checks),
      wire_(std::move(wire_comms)) {}

std::exception_ptr StepDriver::break_with(const char* op, const std::string& why,
                                          std::exception_ptr cause) {
  return failure_.break_with(op, steps_.step(), why, std::move(cause));
}

void StepDriver::break_if_out_of_step(const char* op, std::exception_ptr cause) {
  if (failure_.state() == StepFailure::State::kOutOfStep) {
    if (auto first = failure_.out_of_step_cause()) cause = first;
    std::rethrow_exception(
        break_with(op, "its collectives may no longer match the other ranks'", cause));
  }
}

void StepDriver::begin_forward(bool gradient_sync, std::exception_ptr refusal) {
  failure_.check_usable();
  training_ = c10::GradMode::is_enabled();
  gradient_sync_ = gradient_sync;
  // Before the step's first collective; an evaluation forward leaves the stats alone.
  if (training_) wire_.start();
  // First: a rank that called finish() (or refuses) meets this one here.
  steps_.start_step("forward", std::move(refusal));
  state_ = training_ ? State::kTraining : State::kEvaluating;
  try {
    participant_.start_forward(training_, gradient_sync);
  } catch (const StepBreak& b) {
    state_ = State::kIdle;
    std::rethrow_exception(break_with("forward", b.why, b.cause));
  } catch (...) {
    state_ = State::kIdle;
    std::rethrow_exception(break_with("forward", "a collective at the start of the step failed",
                                      std::current_exception()));
  }
}

void StepDriver::end_forward() {
  try {
    participant_.end_forward(training_);
  } catch (const StepBreak& b) {
    state_ = State::kIdle;
    std::rethrow_exception(break_with("forward", b.why, b.cause));
  } catch (...) {
    state_ = State::kIdle;
    break_if_out_of_step("forward");
    throw;
  }
  if (training_) {
    state_ = State::kAwaitingBackward;  // agreed at the end of backward()
    return;
  }
  // An evaluation forward has no backward: its outcome is agreed here.
  state_ = State::kIdle;
  if (auto failure = steps_.agree(StepSync::Point::kForwardEnd, "forward", nullptr)) {
    participant_.reset_after_failure(false);  // as the failing rank does
    std::rethrow_exception(failure);
  }
}

void StepDriver::forward_failed(std::exception_ptr error) noexcept {
  state_ = State::kIdle;
  if (failure_.broken()) return;
  try {
    break_if_out_of_step("forward", error);
    participant_.issue_as_peers_do(training_, gradient_sync_);
    steps_.agree(training_ ? StepSync::Point::kBackwardEnd : StepSync::Point::kForwardEnd,
                 "forward", error);
  } catch (const StepBreak& b) {
    break_with("forward", b.why, b.cause ? b.cause : error);
  } catch (...) {
    // The agreement broke itself; anything else leaves the collectives unknown.
    break_with("forward", "its collectives may no longer match the other ranks'",
               std::current_exception());
  }
  // Broken: the next call throws; forward() rethrows `error` now.
  if (training_) end_step(participant_.step_counters());
  if (!failure_.broken()) participant_.reset_after_failure(training_);
}

void StepDriver::backward(const at::Tensor& loss, bool gradient_sync) {
  failure_.check_usable();
  if (state_ != State::kAwaitingBackward) {
    // A loss computed outside forward(): the step starts here.
    training_ = true;
    wire_.start();
  }
  std::exception_ptr failure;
  try {
    failure = participant_.run_backward(loss, gradient_sync);
  } catch (const StepBreak& b) {
    state_ = State::kIdle;
    end_step(participant_.step_counters());
    std::rethrow_exception(break_with("backward", b.why, b.cause));
  }
  state_ = State::kIdle;
  try {
    break_if_out_of_step("backward");
  } catch (...) {
    end_step(participant_.step_counters());
    throw;
  }
  auto outcome = steps_.agree(StepSync::Point::kBackwardEnd, "backward", failure);
  if (outcome) {
    end_step(participant_.step_counters());
    participant_.reset_after_failure(true);
    std::rethrow_exception(outcome);
  }
  participant_.commit_backward(gradient_sync);
  end_step(participant_.step_counters());
}

void StepDriver::end_step(StepStats counters) {
  counters.wire = wire_.started() ? wire_.finish() : WireStats{};
  stats_ = std::move(counters);
}

void StepDriver::finish() { steps_.finish(); }

}  // namespace dtrain

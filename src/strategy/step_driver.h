// The step protocol, once for every strategy: SingleDevice, DataParallel and
// FullyShardedDataParallel each plug what differs (a StepParticipant) into a StepDriver,
// which owns what is the same:
//   - the agreements (StepSync): start of every forward, end of every backward and of every
//     evaluation forward, finish();
//   - the one failure state (StepFailure), and the failure policy: a failure that left the
//     collectives in step is agreed and the step dropped on every rank (the strategy stays
//     usable); one that may not have breaks the strategy;
//   - the step's wire accounting (StepWire) and its StepStats.
//
// A step, as the driver sees it (each arrow one of its calls, each checked):
//
//   IDLE --begin_forward (grad mode on)--> TRAINING --end_forward--> AWAITING_BACKWARD
//     ^                                        |                            |
//     |                               forward_failed (fn threw)        backward
//     +----------------------------------------+----------------------------+
//   IDLE --begin_forward (grad mode off)--> EVALUATING --end_forward / forward_failed--> IDLE
//
// backward() from IDLE is a loss computed outside forward(); it runs as a step of its own.
// Under StepChecks::kAuto on a device the per-step agreements cost a host sync, so the
// driver skips them (StepSync's policy): a failure then breaks only the failing rank, and the
// happy path waits for nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/strategy.h"
#include "strategy/step_failure.h"
#include "strategy/step_sync.h"
#include "strategy/step_wire.h"

namespace dtrain {

// Thrown by a participant where this rank's collectives may no longer match its peers': the
// driver breaks the strategy, naming `why` and the cause.
struct StepBreak {
  std::string why;
  std::exception_ptr cause;
};

// Throws StepBreak{why, the exception being handled}; call inside a catch block.
[[noreturn]] void break_step(std::string why);

// What a strategy does in each part of a step. A participant's calls run between the
// driver's agreements; each may throw StepBreak (see above). Other exceptions from
// start_forward and issue_as_peers_do break too; from end_forward and run_backward they are
// the caller's mistake found before anything was issued, and reach the caller unchanged.
class StepParticipant {
 public:
  virtual ~StepParticipant() = default;

  // After the start agreement: what precedes the module's code (FSDP gathers the root, DDP
  // broadcasts buffers).
  virtual void start_forward(bool training, bool gradient_sync) = 0;
  // The module's code returned.
  virtual void end_forward(bool /*training*/) {}
  // The module's code threw on this rank: issue, with dummy data, what a peer whose forward
  // succeeded still issues in this step (its backward when training), so that every rank
  // reaches the step's agreement.
  virtual void issue_as_peers_do(bool training, bool gradient_sync) = 0;
  // loss.backward() and the gradient communication, waited for. Returns this rank's failure
  // that left the collectives in step (autograd threw, a hook's continuation failed), or null.
  virtual std::exception_ptr run_backward(const at::Tensor& loss, bool gradient_sync) = 0;
  // Every rank's backward succeeded: hand the gradients to the optimizer (FSDP adds its
  // shards' gradients) and finish the step's bookkeeping.
  virtual void commit_backward(bool /*gradient_sync*/) {}
  // The step failed (here or on a peer) and every rank agreed: return to a clean state.
  // `training`: the step was a training step (its gradients are dropped), else an evaluation.
  virtual void reset_after_failure(bool training) noexcept = 0;
  // The counters of the step so far (bytes, collectives, waits); the driver adds the wire.
  virtual StepStats step_counters() const { return {}; }
};

class StepDriver {
 public:
  enum class State { kIdle, kTraining, kAwaitingBackward, kEvaluating };

  // `comm`: the ranks that step together, null for a single rank (no communication).
  // `wire_comms`: every communicator the strategy sends on, for StepStats::wire.
  StepDriver(std::string strategy, CommunicatorPtr comm, StepChecks checks,
             std::vector<CommunicatorPtr> wire_comms, StepParticipant& participant);
  StepDriver(const StepDriver&) = delete;
  StepDriver& operator=(const StepDriver&) = delete;

  // Strategy::begin_forward. `refusal`: this rank refuses the step before anything is
  // issued (a misuse); every rank then throws, this one `refusal`, and the strategy stays
  // usable.
  void begin_forward(bool gradient_sync, std::exception_ptr refusal = nullptr);
  void end_forward();
  void forward_failed(std::exception_ptr error) noexcept;
  void backward(const at::Tensor& loss, bool gradient_sync);
  void finish();

  // Throws the sticky CommError once broken (for calls between steps: grad_norm, state).
  void check_usable(const char* /*op*/) const { failure_.check_usable(); }
  StepFailure& failure() { return failure_; }
  State state() const { return state_; }
  bool training() const { return training_; }
  int64_t step() const { return steps_.step(); }

  // The last training step's StepStats.
  const StepStats& last_stats() const { return stats_; }
  // Bytes sent after the step on the strategy's communicators that belong to it (FSDP's
  // grad_norm() all-reduce); `fn` runs and its wire joins last_stats().
  template <typename Fn>
  auto counting_wire(Fn&& fn) {
    const WireStats before = wire_.read();
    auto result = fn();
    stats_.wire += wire_.read().since(before);
    return result;
  }

 private:
  // Breaks (once) and returns the CommError to throw.
  std::exception_ptr break_with(const char* op, const std::string& why, std::exception_ptr cause);
  // kOutOfStep becomes kBroken at the driver's checks (`cause` when out_of_step() gave none).
  void break_if_out_of_step(const char* op, std::exception_ptr cause = nullptr);
  void end_step(StepStats counters);

  StepParticipant& participant_;
  StepFailure failure_;  // before steps_, which refers to it
  StepSync steps_;
  StepWire wire_;
  StepStats stats_;
  State state_ = State::kIdle;
  bool training_ = false;      // the running (or last) forward had grad mode on
  bool gradient_sync_ = true;  // the running forward's Strategy::requires_gradient_sync()
};

}  // namespace dtrain

// The FSDP schedule: which unit moves when. It owns the units and drives their transitions
// (fsdp/unit.h) from four kinds of events:
//
//   forward    begin_forward() gathers the root; enter_unit() / exit_unit() bracket a unit's
//              forward (gather before, free after under FULL_SHARD / HYBRID_SHARD, forward
//              prefetch of the next unit); hook_outputs() arranges the pre-backward gather on
//              the unit's output, for calls whose backward reads the parameters
//              (ParamsInBackward); end_forward() records and checks the unit order.
//   backward   arm() at its start; a hook on each parameter's gradient accumulator counts the
//              unit down, and reductions launch strictly in the agreed reverse order, so every
//              rank issues the same collectives in the same order; flush() launches what got
//              no gradient, complete() waits, accumulate() adds the shards' gradients. Over
//              replicas (NO_SHARD, HYBRID_SHARD) a unit's all-reduce is issued during backward
//              too: at once without a shard group, else when the next unit's reduce-scatter
//              is issued (its own had that unit's backward to finish). With
//              gradient sync off, complete units are held (unsharded) instead of reduced, in
//              the same order, and complete() / accumulate() have nothing to do.
//   prefetch   BACKWARD_PRE gathers the next unit when a unit's backward starts, BACKWARD_POST
//              once a unit's reduction is issued, forward prefetch while a unit's forward runs;
//              at most limit_all_gathers units are gathered ahead of use.
//   failures   finish_forward_as_peers_do() and replay() issue, with dummy buffers, what a
//              peer whose step succeeded still issues; reset() returns every unit to
//              SHARDED / IDLE.
//
// The unit order is recorded in the first iteration (compared across ranks by a digest) and
// any later change is an error.
//
// Phase (Schedule::Phase), changed only by the transitions named on the arrows, each of which
// checks where it starts from and otherwise throws, as the units' transitions do, e.g.
// "internal error: FSDP schedule is RECORDED, disarm needs ARMED":
//
//   UNRECORDED --end_forward()--> RECORDED --arm()--> ARMED --disarm()--> DRAINING
//   (no forward has recorded        ^  ^   (forwards,  (backward: gradient    |  (after autograd:
//    the unit order yet; forwards   |  |   evaluation) hooks count down and   |   flush, replay,
//    run here until one does)       |  |               launch reductions)     |   complete)
//                                   |  +------------------ end_backward() ----+
//                                   +-- reset() from any phase once recorded (a failed step)
//
// Collectives issued while ARMED or DRAINING are the backward's (logged for replay). Two
// things are not phases: the gradient-sync setting (set_gradient_sync, a step's
// configuration that forward and backward both read) and failures: a collective or
// transition that fails puts the strategy's StepFailure out of step (strategy/step_failure.h),
// and the StepDriver breaks the strategy.
//
// The schedule's lock is its own: gradient hooks take it on autograd's threads, and the
// public calls that run while they may (backward(), commit_backward(), counters(), log())
// take it themselves.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/fsdp.h"
#include "dtrain/strategy.h"
#include "fsdp/unit.h"
#include "strategy/grad_hooks.h"
#include "strategy/step_failure.h"

namespace torch::nn {
class Module;
}

namespace dtrain::fsdp {

struct ScheduleOptions {
  // After a unit's forward (FsdpOptions::reshard_after_forward, resolved): kHost only with
  // a shard group.
  ReshardAfterForward after_forward = ReshardAfterForward::kAll;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  int limit_all_gathers = 2;
  bool keep_gathered_between_calls = true;
};

class Schedule final : private UnitObserver {
 public:
  using Clock = std::chrono::steady_clock;

  // Reports failures to `failure`, which must outlive it.
  Schedule(ScheduleOptions options, UnitComms comms, StepFailure& failure);
  ~Schedule() override;
  Schedule(const Schedule&) = delete;
  Schedule& operator=(const Schedule&) = delete;

  // Adds a unit (index 0, the first added, is the root) owning `flat`. Its gradients are
  // hooked; under a shard group it is resharded at once.
  void add_unit(std::string name, const torch::nn::Module* module, FlatParam flat);

  size_t num_units() const { return units_.size(); }
  Unit& unit(size_t index) { return units_[index]; }
  const Unit& unit(size_t index) const { return units_[index]; }
  const UnitComms& comms() const { return comms_; }
  // Index of the unit whose module is `m`; -1 when `m` is not a unit.
  int unit_of(const torch::nn::Module& m) const;

  // --- forward ---
  void begin_forward();
  // Enter a unit's forward: checks the order, gathers it, prefetches the next. Returns its
  // position in this forward's order (what exit_unit and hook_outputs take), or -1 when `m`
  // is not a non-root unit, or is one whose forward is already running (a unit_call nested
  // in the unit's own, e.g. the model's unit_call around a Sequential entry FSDP routes
  // itself: the outer call gathers and frees): nothing to do. `reads_in_backward`: whether
  // this call's backward reads the unit's parameters (ParamsInBackward); part of the order.
  int enter_unit(const torch::nn::Module& m, bool reads_in_backward = true);
  // Leave it: frees it under FULL_SHARD / HYBRID_SHARD (and, when the call's backward reads
  // no parameters, bumps their version counters so that a saved one is reported, not read).
  // `threw`: its forward failed, leave it as a peer's successful call would.
  void exit_unit(int position, bool threw);
  // The unit's output tensors: when the first of their gradients arrives, the unit is
  // gathered for its backward (once per use, whichever output backward reaches first).
  void hook_outputs(int position, const std::vector<at::Tensor>& outputs);
  // End of the forward: in the first iteration, checks that every unit ran and that every
  // rank of `world` ran them in the same order (a collective), and records the order.
  void end_forward(Communicator& world);
  enum class Phase { kUnrecorded, kRecorded, kArmed, kDraining };
  static const char* name_of(Phase phase);
  Phase phase() const { return phase_; }
  // Whether a forward completed end_forward (the order is recorded).
  bool order_recorded() const { return phase_ != Phase::kUnrecorded; }
  // Unit names in forward order, as recorded in the first iteration.
  const std::vector<std::string>& order_names() const { return order_names_; }
  // Whether a recorded call's backward reads no parameters (ParamsInBackward::kNotRead).
  bool has_unread_calls() const {
    return std::find(recorded_reads_.begin(), recorded_reads_.end(), 0) != recorded_reads_.end();
  }

  // --- backward ---
  // Whether the next backward reduces (Strategy::requires_gradient_sync()); set before a
  // forward (a failed forward replays the backward of this mode) and before backward.
  void set_gradient_sync(bool sync) { sync_ = sync; }
  // A backward: ARMED while `autograd` (loss.backward()) runs, then DRAINING: what got no
  // gradient reduces, every reduction is waited for, RECORDED again. When autograd throws,
  // the rest of a peer's backward is replayed with dummy data. Returns autograd's failure
  // (the collectives stayed in step), or null; throws StepBreak when the collectives may no
  // longer match the peers'. `world_size`: the strategy's ranks (one has no peers).
  std::exception_ptr backward(const std::function<void()>& autograd, int world_size);
  // Every rank's backward succeeded: the reduced gradients are added to the shards' .grad
  // and every unit is freed.
  void commit_backward();
  // backward()'s phase transitions, each checked (the caller holds no lock: hooks only read
  // the phase under the schedule's own).
  // RECORDED -> ARMED: every unit expects its gradients; collectives are the backward's.
  void arm();
  // ARMED -> DRAINING: autograd is done; gradient hooks that still fire do nothing.
  void disarm();
  // DRAINING -> RECORDED.
  void end_backward();
  // A collective or transition of the schedule failed: the strategy's StepFailure is out of
  // step (or broken).
  bool failed_in_step() const { return out_of_step(); }
  // Frees every unit (also prefetched but unused ones).
  void reshard_all();

  // --- failures ---
  // The forward threw on this rank: issue what a peer whose forward succeeded still issues
  // (the rest of the forward's gathers, and the last backward's collectives when
  // `training`). Throws StepBreak when those are unknown (the first step).
  void issue_as_peers_do(bool training, int world_size);
  // A collective of a step as another rank issues it, for replaying.
  struct Issued {
    Collective kind;
    int unit;
    bool operator==(const Issued& o) const { return kind == o.kind && unit == o.unit; }
  };
  // Collectives of the running backward so far; of the last successful one with the same
  // gradient sync setting (a backward without sync issues only the all-gathers).
  // Any phase -> RECORDED (UNRECORDED stays): every unit SHARDED / IDLE.
  void reset();

  // --- what the step did ---
  // A step begins: its counters and log start empty.
  void begin_step();
  StepStats counters() const;
  std::vector<std::string> log() const;

 private:
  bool sharded() const { return comms_.shard != nullptr; }
  bool frees_after_forward() const { return options_.after_forward != ReshardAfterForward::kNone; }
  // Frees the unit after a call (frees_after_forward()): to the host pieces under kHost when
  // the call's backward will gather it (`reads_in_backward`, grad mode on), else fully.
  void free_after_call(Unit& u, bool reads_in_backward);
  // Whether the unit of the forward's call at `position` stays gathered after it, for a later
  // call of the same unit in this forward (keep_gathered_between_calls; from the recorded
  // order, so every rank decides alike).
  bool kept_for_later_call(size_t position) const {
    return options_.keep_gathered_between_calls && order_recorded() &&
           position < later_call_.size() && later_call_[position];
  }
  // Throws (and marks the step failed) unless the phase is one of `from`.
  void expect(const char* transition, std::initializer_list<Phase> from);
  void prefetch(int index, const char* why);
  void pre_backward(int position);
  void on_grad_ready(int index);
  // Everything that got no gradient reduces now, in order.
  void flush();
  // Waits for every reduction.
  void complete();
  // Adds the reduced gradients to the shards' .grad.
  void accumulate();
  const std::vector<Issued>& last_backward_log() const { return last_backward_log_[sync_]; }
  bool out_of_step() const { return failure_.state() != StepFailure::State::kHealthy; }
  void finish_forward_as_peers_do();
  void replay(const std::vector<Issued>& ops, size_t from);
  // Launches (or holds, without sync) the reductions whose turn came and whose gradients
  // are complete.
  void launch_ready_reductions();
  // Issues the replica all-reduces of the launched units before reduce_order_ position `end`.
  void replicate_until(size_t end);

  // UnitObserver
  void issued(Collective kind, int unit, int64_t bytes) override;
  void record(std::string entry) override { log_.push_back(std::move(entry)); }
  void waited(Clock::duration d) override;
  void failed() noexcept override { failure_.out_of_step(nullptr); }

  ScheduleOptions options_;
  UnitComms comms_;
  StepFailure& failure_;
  std::vector<Unit> units_;  // units_[0] is the root
  std::map<const torch::nn::Module*, int> unit_of_module_;

  // Execution order: unit indices in forward order (recorded each iteration, compared with
  // the first); reductions launch in the reverse order, root last.
  std::vector<int> forward_order_, recorded_order_;
  // Per position: whether that call's backward reads the unit's parameters.
  std::vector<char> forward_reads_, recorded_reads_;
  // Per unit: whether any recorded call's backward reads its parameters (BACKWARD_POST
  // prefetches only those).
  std::vector<char> gathered_in_backward_;
  // Per recorded position: whether the same unit is called again later in the forward.
  std::vector<char> later_call_;
  std::vector<std::string> order_names_;
  Phase phase_ = Phase::kUnrecorded;
  std::vector<char> ran_;
  std::vector<char> running_;  // between enter_unit and exit_unit
  std::vector<int> reduce_order_;
  size_t next_reduce_ = 0;
  size_t next_replicate_ = 0;  // reduce_order_ position of the next unit to all-reduce
  bool sync_ = true;           // the step's gradient-sync setting
  Clock::time_point first_reduce_;

  std::vector<Issued> backward_log_, last_backward_log_[2];  // [sync]

  mutable std::mutex mu_;
  StepStats stats_;
  std::vector<std::string> log_;
  GradReadyHooks hooks_;  // last: destroyed first, so no hook runs on a dying schedule
};

}  // namespace dtrain::fsdp

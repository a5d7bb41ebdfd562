// An FSDP unit: a FlatParam plus the two state machines that say where its parameters and its
// gradient are (FSDP2's FSDPParamGroup). The transitions below are the only way to change
// them; each checks the state it starts from and throws an internal Error naming the unit,
// the transition and both states otherwise, so a scheduling bug surfaces as a named wrong
// transition, never as a hang or wrong numbers.
//
// Parameters (ParamState):
//   SHARDED    only the fp32 shard is current; full has no memory (sharded) or stale contents
//              (one shard: refreshed at the next unshard)
//   SHARDED_POST_FORWARD  (ReshardAfterForward::kHost) full has no memory; this rank keeps
//              its 1/L of full (L: ranks of its host), so that the next gather stays
//              inside the host
//   GATHERING  an all-gather into full is in flight
//   UNSHARDED  full holds the current parameters; the module computes with them
//
//   unshard()            SHARDED   -> GATHERING  (-> UNSHARDED at once without a shard group)
//                        SHARDED_POST_FORWARD -> GATHERING (over the host; -> UNSHARDED at
//                        once for one rank per host)
//   wait_unsharded()     GATHERING -> UNSHARDED
//   reshard()            UNSHARDED -> SHARDED    (frees full's memory when sharded)
//   reshard_to_host()    UNSHARDED -> SHARDED_POST_FORWARD (copies the host piece, frees full)
//
// Gradient (GradState), within one backward:
//   IDLE          no backward in progress
//   ACCUMULATING  backward armed; pending() parameters still wait for their gradient
//   HELD          gradient sync off (no_sync): the unit's unsharded gradient, summed over
//                 the micro-batches so far, is kept (fp32) instead of reduced
//   REDUCING      flattened and reduce-scattered within the shard group (in flight; done at
//                 once without a shard group)
//   REPLICATING   the reduced shard is all-reduced over the replicas (NO_SHARD, HYBRID_SHARD)
//   REDUCED       the averaged shard gradient is ready, to be added to the shard's .grad
//                 (or its views', FlatParam::add_to_shard_grad) once every rank agreed
//                 that the step succeeded
//
//   arm()                 IDLE or HELD -> ACCUMULATING
//   gradient_arrived()    ACCUMULATING (one parameter's gradient is accumulated)
//   hold()                ACCUMULATING -> HELD       (the unit's parameters are resharded)
//   launch_reduction()    ACCUMULATING -> REDUCING   (resharded; a held sum is included)
//   replicate()           REDUCING     -> REPLICATING (waits for the reduce-scatter)
//   complete_reduction()  REPLICATING  -> REDUCED, or REDUCING -> REDUCED without replicas
//   accumulate()          REDUCED      -> IDLE
//
// reset() (a failed step) takes any state to SHARDED / IDLE, dropping the gradient, after
// waiting for the unit's collectives in flight.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "compat/torch_compat.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/quantization.h"
#include "dtrain/work.h"
#include "fsdp/flat_param.h"

namespace torch::nn {
class Module;
}

namespace dtrain::fsdp {

// The groups a unit communicates over and the dtype gradients are reduced in.
struct UnitComms {
  CommunicatorPtr shard;      // null: one shard, nothing to gather or reduce-scatter
  CommunicatorPtr replicate;  // null: no replicas to all-reduce over
  // ReshardAfterForward::kHost: the ranks of this host (null: one), over which a unit in
  // SHARDED_POST_FORWARD is gathered. Its size divides the shard group's.
  CommunicatorPtr host;
  int host_size = 1, host_rank = 0;
  c10::ScalarType reduce_dtype = c10::ScalarType::Float;
  // The parameters' all-gather over `shard` quantised on the wire (FsdpOptions).
  Quantization quantize_params = Quantization::kNone;
  // The gradients' reduce-scatter over `shard` quantised on the wire, reduced in fp32.
  Quantization quantize_grads = Quantization::kNone;
  // With quantize_grads, the ranks of this host (FsdpOptions::host_group, checked to be
  // consecutive ranks of `shard`): the reduce-scatter goes in two levels, fp32 inside the
  // host and quantised between hosts. Null: one level over `shard`.
  CommunicatorPtr grad_host;
  int64_t quantization_block = kDefaultQuantizationBlock;
  int rank = 0, world_size = 1;  // of the whole job, for messages
};

// The gradients' reduce-scatter of a unit as `c` says: over c.shard, averaged, in
// c.reduce_dtype or quantised on the wire (in two levels with c.grad_host). `bytes`: this
// rank's payload.
WorkPtr reduce_scatter_grads(const UnitComms& c, at::Tensor out, const at::Tensor& flat,
                             int64_t* bytes);

// kHostAllGather: a SHARDED_POST_FORWARD unit's gather over UnitComms::host.
enum class Collective { kAllGather, kReduceScatter, kAllReduce, kHostAllGather };

// What a unit reports while it moves: the schedule logs collectives, counts their bytes,
// remembers them for replay after a failure, and learns that the step's collective stream
// may no longer match the peers' (failed()).
class UnitObserver {
 public:
  virtual ~UnitObserver() = default;
  // A collective was issued (bytes: this rank's payload).
  virtual void issued(Collective kind, int unit, int64_t bytes) = 0;
  // An entry for last_collective_log(), e.g. "all_gather:h.0 (prefetch)".
  virtual void record(std::string entry) = 0;
  // The caller waited this long on a collective.
  virtual void waited(std::chrono::steady_clock::duration d) = 0;
  // A transition's precondition or a collective failed.
  virtual void failed() noexcept = 0;
};

class Unit {
 public:
  enum class ParamState { kSharded, kShardedPostForward, kGathering, kUnsharded };
  enum class GradState { kIdle, kAccumulating, kHeld, kReducing, kReplicating, kReduced };
  static const char* name_of(ParamState s);
  static const char* name_of(GradState s);

  // A new unit is UNSHARDED (its parameters are current in full) and IDLE.
  Unit(int index, std::string name, FlatParam flat, const UnitComms* comms, UnitObserver* observer);
  Unit(Unit&&) = default;

  int index() const { return index_; }
  const std::string& name() const { return name_; }
  FlatParam& flat() { return flat_; }
  const FlatParam& flat() const { return flat_; }
  ParamState param_state() const { return state_; }
  GradState grad_state() const { return grad_; }
  // ACCUMULATING: parameters whose gradient has not arrived yet.
  int pending() const { return pending_; }
  // HELD (and ACCUMULATING after HELD): the unsharded fp32 gradient sum kept without sync.
  const at::Tensor& held_gradient() const { return held_; }

  // --- parameter transitions (see the file comment); `why` is appended to the log entry ---
  void unshard(const char* why);
  void wait_unsharded();
  void reshard();
  void reshard_to_host();
  // unshard() unless a gather is under way or done, then wait: what a unit needs before it
  // computes.
  void ensure_unsharded();
  // reshard() from any state; a gather in flight is waited for first (its buffer is never
  // freed while a collective writes it). SHARDED_POST_FORWARD drops the host piece.
  void reshard_any();

  // --- gradient transitions ---
  void arm();
  // Returns true when this was the last parameter the unit waited for.
  bool gradient_arrived();
  // The parameters that have not got a gradient will not get one in this backward.
  void stop_waiting();
  void hold();
  void launch_reduction();
  // Issues the all-reduce over the replicas (only with a replicate group), without waiting
  // for it: what overlaps it with the rest of backward.
  void replicate();
  void complete_reduction();
  void accumulate();

  void reset();

 private:
  ErrorContext ctx(const char* op) const;
  void expect(const char* transition, ParamState from);
  void expect(const char* transition, GradState from);
  void expect(const char* transition, GradState from, GradState or_from);
  // Runs a collective call; an exception from it means this rank's collectives may no longer
  // match its peers'.
  template <typename Fn>
  void collective(Fn&& fn);
  // unshard() from SHARDED_POST_FORWARD.
  void unshard_from_host(const char* why);

  int index_;
  std::string name_;
  FlatParam flat_;
  const UnitComms* comms_;
  UnitObserver* observer_;

  ParamState state_ = ParamState::kUnsharded;
  WorkPtr gather_work_;      // GATHERING only
  at::Tensor gather_input_;  // kept alive while gather_work_ runs
  at::Tensor host_piece_;    // SHARDED_POST_FORWARD: this rank's 1/host_size of full

  GradState grad_ = GradState::kIdle;
  int pending_ = 0;
  at::Tensor held_;         // fp32, `padded` elements; undefined when nothing is held
  WorkPtr reduce_work_;     // REDUCING: the reduce-scatter (null without a shard group)
  WorkPtr replicate_work_;  // REPLICATING: the all-reduce over replicas
  at::Tensor reduce_out_;   // REDUCING / REPLICATING / REDUCED
};

}  // namespace dtrain::fsdp

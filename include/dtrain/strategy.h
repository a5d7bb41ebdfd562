// Strategy: one training loop for every way of spreading a model over ranks.
//
// clang-format off
//   // or SingleDevice, FullyShardedDataParallel:
//   auto strategy = std::make_shared<dtrain::DataParallel>(model, comm);
//   torch::optim::AdamW opt(strategy->parameters(), options);  // not model->parameters()
//   for (auto& batch : loader) {
//     opt.zero_grad();
//     at::Tensor loss = strategy->forward([&] { return loss_fn(model->forward(batch.x), batch.y); });
//     strategy->backward(loss);       // gradients are reduced when this returns
//     strategy->clip_grad_norm(1.0);  // global norm, whatever the sharding
//     opt.step();                     // steps what parameters() returned
//   }
//   strategy->finish();  // every rank, after its last batch: uneven data is an error
// clang-format on
//
// The wrapped module's code is never changed. forward() takes the module call as a
// function so that any forward signature works and strategies can prepare parameters
// before it (FSDP gathers them) and hook its output (FSDP's pre-backward gather).
//
// Failures (docs/strategies.md): an exception in forward(), backward() or a communication
// hook on any rank makes every rank throw from the same step (the failing rank its own
// exception, the others StepError), with the step's gradients dropped and the strategy ready
// for the next step. Where a rank cannot keep its collectives in step with the others, it
// throws CommError on this and every later call, and its peers fail within the communicator's
// timeout. A forward() run with grad mode on is a training step: backward() must follow it on
// every rank, as in PyTorch's DDP. One with grad mode off is an evaluation; every rank must
// run the same kind at the same step (a rank evaluating while another trains is an
// InvalidArgument on every rank, "rank 1 ran an evaluation forward at step 27 while rank 0
// ran a training step ...": with uneven data, call finish() before evaluating).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/wire_stats.h"

namespace torch::nn {
class Module;
}

namespace dtrain {

// How the ranks of DataParallel and FullyShardedDataParallel agree on each step
// (docs/reliability.md, "Step agreements"): a tiny all-gather at the start of every forward()
// and at the end of every backward() through which a rank's failure or missing batch reaches
// every rank. On a GPU each one is a host read that waits for the device's queue to drain.
enum class StepChecks {
  // Every step where an agreement costs no wait for a device: the communicator's device is
  // the CPU (Gloo, shared memory) or there is one rank. On a device (NCCL, staged Gloo) only
  // finish() agrees; a rank whose step fails throws its own error, issues nothing more
  // (CommError on every later call), and its peers fail at their next collective within the
  // communicator's timeout, never a hang.
  kAuto,
  // Every step on every device, as on the CPU: a failure on any rank makes every rank throw
  // from the same step and the strategy stays usable; a rank without a batch is named. A
  // debug mode on a GPU (as c10d's TORCH_DISTRIBUTED_DEBUG=DETAIL): two host syncs per step.
  kEveryStep,
};

// What the last training step cost in communication (an evaluation forward, grad mode off,
// leaves it alone). Fields that do not apply are 0.
struct StepStats {
  // Payload bytes of the step's gradient collectives as the strategy hands them over, in the
  // gradients' dtype: DDP the buckets given to its comm hook (a compressing hook sends fewer:
  // the bytes actually sent are in `wire`), FSDP its gathers and reduce-scatters.
  int64_t bytes_communicated = 0;
  // Time the caller's thread waited on communication (FSDP: also its gathers).
  double comm_wait_s = 0;
  // Wall-clock span from the step's first gradient collective issued to the last one
  // completed: communication overlaps backward, so this is not a sum of durations and it
  // includes compute between collectives.
  double comm_total_s = 0;
  int64_t num_collectives = 0;  // collectives issued by the step (DDP: buckets)
  // Bytes on the wire (dtrain/wire_stats.h): what this rank's transports sent in the step,
  // per collective kind, to ranks of its own host and of other hosts, counted where they
  // send. The difference of wire_stats() readings, summed over every communicator the
  // strategy uses (FSDP: also its shard, replicate and host groups), from the start of
  // forward() to the end of backward(), plus what grad_norm() / clip_grad_norm() send after
  // it (FSDP's norm all-reduce). Collectives the caller issues on those communicators between
  // forward() and backward() count too. A step with gradient sync off counts its forward and
  // step agreement. wire.counted is false where nothing is counted (NCCL, SingleDevice).
  WireStats wire;
};

// A tensor the optimizer steps, with the module parameter it belongs to: what optimizer
// parameter groups are built from, the same way under every strategy.
struct NamedParameter {
  std::string name;  // the module parameter's qualified name, e.g. "h.0.attn.c_attn.bias"
  // The parameter itself, or under FSDP this rank's part of it (1-D, possibly empty).
  at::Tensor tensor;
  std::vector<int64_t> shape;  // the module parameter's full shape: group by this, not tensor's
};

// One piece of the training state a rank holds: what checkpoints (dtrain/checkpoint.h)
// save and load, whatever the strategy. Every parameter and buffer has one slice on every
// rank, in the same order on every rank; a rank holding none of its elements has an empty
// range.
struct StateSlice {
  enum class Kind { kParameter, kFrozenParameter, kBuffer };
  std::string name;  // qualified name in the module
  Kind kind = Kind::kParameter;
  std::vector<int64_t> shape;  // the full tensor's shape
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t begin = 0, end = 0;  // this rank holds the flattened elements [begin, end)
  at::Tensor data;             // those elements: 1-D, aliasing the strategy's own memory
  at::Tensor stepped;          // the tensor the optimizer steps for them; undefined: none
  int64_t stepped_offset = 0;  // data is stepped's flattened elements [offset, offset + n)
  int replica = 0;             // this rank's index among the ranks holding the same range
  int num_replicas = 1;
};

struct StateLayout {
  std::string sharding;  // how the state is spread, for the manifest, e.g. "replicated"
  CommunicatorPtr comm;  // the ranks holding it; null for a single rank
  std::vector<StateSlice> slices;
  // This rank's own state outside the model, that a resumed run needs to continue exactly
  // (DataParallel: its comm hook's CommHook::state(), e.g. PowerSGD's error feedback and Q).
  // Named CPU tensors; checkpoints save every rank's, and a load at the same world size hands
  // each rank its own through load_rank_state (null: nothing takes it; state saved for
  // another configuration is then left unread).
  std::map<std::string, at::Tensor> rank_state;
  std::function<void(const std::map<std::string, at::Tensor>&)> load_rank_state;
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  // Runs `fn` (the module's forward and, usually, the loss) with the parameters ready.
  // Collective: every rank calls it for every step. When fn throws, the strategy keeps its
  // collectives in step with the other ranks, resets itself and rethrows fn's exception.
  template <typename Fn>
  at::Tensor forward(Fn&& fn) {
    begin_forward();
    at::Tensor out;
    try {
      out = std::forward<Fn>(fn)();
    } catch (...) {
      forward_failed(std::current_exception());
      throw;
    }
    end_forward(out);
    return out;
  }

  // Runs loss.backward() and completes the strategy's gradient communication: when it
  // returns, parameters()' gradients hold the gradient of the global batch (averaged over
  // ranks), ready for the optimizer.
  virtual void backward(const at::Tensor& loss) = 0;

  // The tensors the optimizer must step, what named_parameters() lists: the module's
  // parameters, or under FSDP this rank's part of each (frozen ones whole). Frozen parameters
  // get no gradient, so optimizers leave them alone.
  virtual std::vector<at::Tensor> parameters() = 0;

  // parameters() with the module parameter each one is, in the same order, for optimizer
  // parameter groups that are the same under every strategy:
  //
  // clang-format off
  //   std::vector<at::Tensor> decay, no_decay;
  //   for (auto& p : strategy->named_parameters()) {
  //     (p.shape.size() >= 2 ? decay : no_decay).push_back(p.tensor);
  //   }
  //   std::vector<torch::optim::OptimizerParamGroup> groups;
  //   groups.emplace_back(decay);
  //   groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(no_decay_options));
  //   torch::optim::AdamW opt(std::move(groups), o);
  // clang-format on
  //
  // Every strategy lists every module parameter, frozen ones included, in module order.
  // Under FSDP (FsdpOptions::use_orig_params, the default) each trainable one is this rank's
  // part of the parameter, so decide by name and `shape`, not by the tensor's shape; with
  // use_orig_params false FSDP throws InvalidArgument (a flat shard mixes parameters).
  virtual std::vector<NamedParameter> named_parameters() = 0;

  // L2 norm of the full (global-batch, unsharded) gradient. Call after backward(). Reads
  // the norm on the host: on a GPU the host waits for the step's kernels (grad_norm_tensor()
  // does not).
  virtual double grad_norm() = 0;

  // grad_norm() as a 0-dim double tensor on the gradients' device, computed without a host
  // read (one norm per gradient, as PyTorch's foreach norms; FSDP all-reduces the shards' sum
  // on its communicator's device), so the host keeps queueing work. The default wraps
  // grad_norm() for strategies that do not override it.
  virtual at::Tensor grad_norm_tensor();

  // Gradient accumulation over micro-batches. While gradient sync is off, backward() adds
  // this rank's gradient to what earlier backward() calls left and issues no gradient
  // collective; the first backward() with sync on reduces the accumulated sum, so parameters()'
  // gradients then hold the gradient of the global batch of every micro-batch (scale each
  // micro-batch's loss by 1 / micro-batches for their mean):
  //
  // clang-format off
  //   for (int m = 0; m < n; ++m) {
  //     strategy->set_requires_gradient_sync(m + 1 == n);  // communicate on the last one
  //     strategy->backward(strategy->forward([&] { return loss_of(micro[m]); }) / n);
  //   }
  // clang-format on
  //
  // Every rank must use the same setting in the same step (the step agreements still run).
  // What the local sum costs: SingleDevice and DataParallel nothing (DDP's buckets hold it);
  // FSDP an unsharded fp32 gradient per unit until the synced backward (docs/strategies.md).
  // Strategies read the setting only here, when a step's forward begins and when its
  // backward runs, and pass it on as an argument (no setter reaches into their machinery).
  void set_requires_gradient_sync(bool sync) { gradient_sync_ = sync; }
  bool requires_gradient_sync() const { return gradient_sync_; }

  // Sync off while the guard lives (the previous setting comes back when it is destroyed):
  // clang-format off
  //   { auto guard = strategy->no_sync(); strategy->backward(first_micro_batch_loss); }
  // clang-format on
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(Strategy& strategy)
        : strategy_(strategy), previous_(strategy.requires_gradient_sync()) {
      strategy_.set_requires_gradient_sync(false);
    }
    ~NoSyncGuard() { strategy_.set_requires_gradient_sync(previous_); }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    Strategy& strategy_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // Scales gradients so that their global norm is at most max_norm; returns the norm before
  // clipping (as torch::nn::utils::clip_grad_norm_ does). Reading the returned norm is the
  // step's one host read; clip_grad_norm_tensor() leaves it on the device.
  virtual double clip_grad_norm(double max_norm);

  // clip_grad_norm() without a host read, as PyTorch 2's clip_grad_norm_: the coefficient
  // min(1, max_norm / (norm + 1e-6)) stays on the device and multiplies every gradient (by
  // exactly 1 when no clipping is needed). clip_grad_norm() is this plus reading the norm.
  // Returns grad_norm_tensor(), the norm before clipping.
  at::Tensor clip_grad_norm_tensor(double max_norm);

  // Bytes this rank holds for parameters and gradients (including communication buffers
  // that alias them) plus the given optimizer state tensors, each storage counted once.
  // FULL_SHARD FSDP holds about 1/world_size of DataParallel's between steps.
  virtual int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state = {}) = 0;

  // Checkpoint support: the parameters and buffers this rank holds (see StateSlice); call
  // between steps. state_loaded() must follow writing into the slices' data, so that the
  // strategy refreshes what it derives from them (FSDP's gathered compute copies).
  // The default throws InvalidArgument: the strategy cannot be checkpointed.
  virtual StateLayout state_layout();
  virtual void state_loaded() {}

  // Call on every rank once it has no more batches (instead of another forward()).
  // Collective: returns when every rank called it; throws InvalidArgument on every rank when
  // some rank is still stepping, e.g. "rank 1 had no batch at step 12 while rank 0 did".
  // DataParallel and FSDP (world size > 1) destroyed after training steps without finish()
  // warn once through TORCH_WARN (not while an exception unwinds or after a failed step).
  virtual void finish() {}

  virtual const StepStats& last_step_stats() const = 0;
  virtual std::string name() const = 0;
  // Whether the wrapped module may be called directly, outside forward(), e.g. by one rank
  // alone to evaluate or generate: true for SingleDevice and DataParallel, whose module holds
  // its whole parameters; false under FSDP, whose units gather theirs only inside forward(),
  // which every rank then runs together (a unit reached outside it throws InvalidArgument).
  virtual bool module_runs_outside_forward() const { return true; }
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

 protected:
  // What clip_grad_norm() scales the gradients of: parameters(), taken without handing them
  // out (FSDP counts a call to parameters() as the optimizer being built over its shards).
  virtual std::vector<at::Tensor> stepped_tensors() { return parameters(); }
  virtual void begin_forward() {}
  virtual void end_forward(at::Tensor& /*output*/) {}
  // forward()'s fn threw `error`: issue what the other ranks still expect from this step,
  // agree the failure with them and reset. Must not throw; forward() rethrows `error`.
  virtual void forward_failed(std::exception_ptr /*error*/) noexcept {}

 private:
  bool gradient_sync_ = true;
};

// Bytes held by the defined tensors (each storage counted once).
int64_t tensor_bytes(const std::vector<at::Tensor>& tensors);

// Sum of squares of t's elements, accumulated in double over per-tensor fp32 norms (as
// torch::nn::utils::clip_grad_norm_ does): no double copy of the gradients is made.
double squared_norm(const at::Tensor& t);

// The sum of squared_norm() over the defined, non-empty tensors, as a 0-dim double tensor on
// their device (`device` when there are none), without a host read: one foreach norm per
// dtype, each tensor's norm in its dtype as squared_norm() takes it.
at::Tensor squared_norm_sum(const std::vector<at::Tensor>& tensors, c10::Device device);

}  // namespace dtrain

// FullyShardedDataParallel (FSDP): parameters, gradients and optimizer state sharded over
// ranks, for any torch::nn::Module.
//
// The model is split into units: the whole model is always the root unit; submodules chosen
// by FsdpOptions::wrap_policy become units of their own (typically every transformer block).
// Each unit's parameters are flattened into one padded buffer of which every rank owns
// 1/N (its shard). The optimizer steps the shards (parameters() returns them, in fp32), or
// with FsdpOptions::use_orig_params one view per parameter into them, so that optimizer
// parameter groups (e.g. no weight decay on biases) work as under the other strategies.
// Before a unit computes, its full parameters are all-gathered into the module's own
// parameter tensors; after its forward and its backward they are freed again, so a rank
// holds its shards plus the units in use. Gradients are reduce-scattered per unit as soon
// as the unit's backward is done.
//
// C++ modules have no forward hooks, so FSDP must be told where a unit's forward runs. Two
// ways, both no-ops under every other strategy and outside FSDP:
//
// * A unit that is an entry of a torch::nn::Sequential needs nothing: FSDP replaces the
//   entry in place (for its lifetime) with one that runs the original through unit_call,
//   leaving the Sequential's registered children, hence every parameter name, unchanged.
//   Stock modules become units without any model edit:
//
// clang-format off
//     struct EncoderImpl : torch::nn::Module {
//       EncoderImpl() {
//         for (int i = 0; i < 12; ++i) layers->push_back(torch::nn::TransformerEncoderLayer(768, 12));
//       }
//       at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
//       torch::nn::Sequential layers = register_module("layers", torch::nn::Sequential());
//     };
//     dtrain::FsdpOptions o;
//     o.wrap_policy = dtrain::wrap_modules_named("TransformerEncoderLayer");
// clang-format on
//
// * Anywhere else the model marks the call with dtrain::unit_call:
//
// clang-format off
//     at::Tensor GptImpl::forward(const at::Tensor& idx) {
//       at::Tensor x = wte(idx) + wpe(pos);
//       for (auto& block : blocks) {
//         x = dtrain::unit_call(*block, [&] { return block->forward(x); });
//       }
//       return lm_head(ln_f(x));
//     }
// clang-format on
//
//   This is required for units called through a typed handle (`block->forward(x)`) or held
//   in a torch::nn::ModuleList or ModuleDict: models reach those entries with `->as<T>()`,
//   a dynamic_cast to the concrete type followed by a call bound at compile time to
//   T::forward, so there is no point where FSDP could step in, and a replaced entry would
//   make as<T>() return null. (Sequential is different because it calls its entries itself,
//   through type-erased AnyModule values.)
//
// The strategy is built with a policy that makes those modules units:
//
// clang-format off
//   dtrain::FsdpOptions o;
//   o.wrap_policy = dtrain::wrap_modules_named("Block");    // or wrap_by_min_params(n)
//   auto fsdp = std::make_shared<dtrain::FullyShardedDataParallel>(model, comm, o);
// clang-format on
//
// A submodule that the policy wraps but the model never runs (through a Sequential or
// unit_call) is an error (detected at the first forward), and so is a policy that wraps no
// submodule at all (InvalidArgument at construction; leave wrap_policy unset for the root
// unit alone).
//
// Every forward of the model, evaluation included, must run inside strategy->forward(), on
// every rank: outside it the parameters are sharded. A unit reached outside it throws
// InvalidArgument ("the forward of FSDP unit 'h.0' (BlockImpl) ran outside
// strategy->forward() ..."): a Sequential entry FSDP routes always; a unit_call once its
// parameters were freed (every sharding strategy but NO_SHARD, whose kept parameters are the
// last gathered ones). What FSDP cannot catch: layers the root module calls itself (its own
// parameters, the root unit's). Nothing runs between the caller and those layers (C++ modules
// have no forward hooks), so such a forward fails inside LibTorch ("The tensor has a non-zero
// number of elements, but its data is not allocated yet ..."), or under NO_SHARD or one rank
// computes with the last gathered values.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <ATen/core/Tensor.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/blas.h"
#include "dtrain/communicator.h"
#include "dtrain/deferred_init.h"
#include "dtrain/device_mesh.h"
#include "dtrain/quantization.h"
#include "dtrain/strategy.h"

namespace torch::nn {
class Module;
}

namespace dtrain {

enum class ShardingStrategy {
  kFullShard,    // ZeRO-3: parameters freed after forward and after backward
  kShardGradOp,  // ZeRO-2: parameters kept from forward to the end of backward
  kNoShard,      // every rank keeps everything; gradients all-reduced (DDP-like)
  kHybridShard,  // FULL_SHARD within a shard group, replicated across groups
};

enum class BackwardPrefetch {
  kNone,          // gather a unit only when its backward is about to run
  kBackwardPre,   // when unit k's backward starts, also gather the unit that runs next
  kBackwardPost,  // once unit k's gradients are reduced, gather the unit that runs next
};

// Where a unit's parameters go when its forward is done (FSDP2's reshard_after_forward,
// ZeRO++'s hpZ). Backward needs them again, so this trades memory for the backward's gather.
enum class ReshardAfterForward {
  // Freed: backward gathers them again over the whole shard group (FULL_SHARD's default;
  // FSDP2's True).
  kAll,
  // Sharded only over the ranks of this host (FsdpOptions::host_group): each rank keeps
  // 1/L of the unit's full parameters (L ranks per host) until the unit's backward, which
  // gathers them inside the host, so backward's all-gathers never cross the network. Costs
  // that 1/L per unit from its forward to its backward (FSDP2's int). The result is the
  // same as kAll's, bit for bit: the pieces are copies of what forward computed with.
  kHost,
  // Kept gathered until the unit's backward is done (SHARD_GRAD_OP's; FSDP2's False).
  kNone,
};

struct MixedPrecision {
  // Dtype of the gathered parameters the module computes with (e.g. kBFloat16); unset: fp32.
  // Exception: the weight and bias of a module with fp32 running statistics of its own
  // (torch::nn::BatchNorm{1,2,3}d, dtrain::SyncBatchNorm, InstanceNorm with
  // track_running_stats; a floating-point "running_mean" buffer, fp32 after buffer_dtype)
  // compute in fp32, holding param_dtype's rounding of their values: ATen's batch_norm takes a
  // low-precision input only with fp32 weight, bias and statistics, and the statistics stay in
  // fp32 as under DataParallel. (PyTorch's FSDP1 runs such modules in fp32 the same way;
  // FSDP2 fails there with "Expected running_mean to have type BFloat16".)
  c10::optional<c10::ScalarType> param_dtype;
  // Dtype gradients are reduced in; unset: param_dtype (or fp32).
  c10::optional<c10::ScalarType> reduce_dtype;
  // Dtype of the module's floating-point buffers (e.g. BatchNorm statistics) while it trains;
  // unset: unchanged (fp32 statistics, with fp32 norm parameters: see param_dtype).
  // Buffers are not sharded: they are cast once, at construction, and stay in this dtype
  // (the module updates them in it). full_state_dict() and checkpoints hold them in their
  // original dtype, so they load under any strategy.
  c10::optional<c10::ScalarType> buffer_dtype;
  // With param_dtype set: forward()'s function runs in an ATen autocast region of param_dtype
  // (dtrain/autocast.h) for the parameters' device type, so fp32 tensors reaching a matmul,
  // convolution or linear (the model's inputs, or what an fp32 op produced) are cast to
  // param_dtype there: the caller passes fp32 inputs as under the other strategies, as FSDP2's
  // MixedPrecisionPolicy.cast_forward_inputs casts a module's inputs. Autocast also computes
  // the ops on its fp32 list in fp32 (losses such as cross_entropy, mse_loss and nll_loss; on
  // CUDA also softmax, layer_norm and others, whose outputs are then fp32). Applies on the CPU
  // with bf16 (ATen's CPU autocast has no fp16) and on CUDA; elsewhere, and with false, the
  // forward runs as written, every input in param_dtype the caller's job. Backward runs outside
  // the region, as in PyTorch.
  bool cast_forward_inputs = true;
  // param_dtype bf16 with the module on the CPU, on a CPU without native bf16 (avx512_bf16,
  // AMX-BF16): it trains, many times slower than fp32, and rank 0 warns once at construction
  // through TORCH_WARN. cpu_check.warn = false: no warning.
  Bf16CpuCheck cpu_check;
};

// Decides whether a submodule becomes its own unit. Arguments: the submodule's qualified
// name (e.g. "h.3") and the module itself.
using WrapPolicy = std::function<bool(const std::string& name, const torch::nn::Module& module)>;

// Wraps every submodule whose name() (the C++ type name LibTorch records, e.g. "BlockImpl"
// or the name given to Module's constructor) contains `type_name`.
WrapPolicy wrap_modules_named(std::string type_name);
// Wraps every submodule whose subtree (its own parameters and its children's, as PyTorch's
// size_based_auto_wrap_policy counts) holds at least `min_params` parameters; a qualifying
// module's qualifying children become units nested in it.
WrapPolicy wrap_by_min_params(int64_t min_params);

struct FsdpOptions {
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  // Gather unit k+1 while unit k's forward runs (order taken from the previous iteration).
  bool forward_prefetch = false;
  // What happens to a unit's parameters after its forward (see ReshardAfterForward). Unset:
  // the sharding strategy's own (FULL_SHARD, HYBRID_SHARD: kAll; SHARD_GRAD_OP, NO_SHARD:
  // kNone). Set, it overrides FULL_SHARD's and SHARD_GRAD_OP's (FULL_SHARD with kNone is
  // SHARD_GRAD_OP, SHARD_GRAD_OP with kAll is FULL_SHARD) and HYBRID_SHARD's; NO_SHARD
  // accepts only kNone (it never frees). kHost needs host_group. Calls whose backward reads
  // no parameters (ParamsInBackward::kNotRead) and forwards without grad mode (nothing to
  // gather for) free the unit fully under kHost too.
  std::optional<ReshardAfterForward> reshard_after_forward;
  // Deprecated (one release more): give FSDP a DeviceMesh with host groups instead
  // (DeviceMeshOptions::local_world_size). A communicator of the ranks of this host, e.g.
  // make_host_group(); every rank passes one or none. Used by:
  //  - ReshardAfterForward::kHost, which gathers over it after forward (any group of ranks
  //    works; its size must divide the shard group's);
  //  - quantize_grads, when it is smaller than the shard group: the reduce-scatter goes in
  //    two levels (ZeRO++'s hierarchical qgZ), an fp32 sum inside the host, then each host's
  //    sum quantised between hosts, so every value crosses hosts once instead of once per
  //    rank of its host. Its ranks must then be consecutive ranks of the shard group, in
  //    order (make_host_group's layout; checked at construction, InvalidArgument).
  // Ignored otherwise.
  CommunicatorPtr host_group;
  // Most units gathered ahead of use at once (prefetches beyond this wait), bounding memory.
  int limit_all_gathers = 2;
  // A unit called more than once in a forward (weight sharing, e.g. a tied embedding looked
  // up first and used as the LM head last) stays gathered from its first call to its last,
  // instead of being freed after each call and gathered again: one all-gather per forward
  // instead of one per call, for holding its parameters in between. From the second
  // iteration on (the first records which call is the last). false: freed after every call,
  // the least memory. Only where units are freed after forward (reshard_after_forward kAll or
  // kHost; FULL_SHARD / HYBRID_SHARD by default).
  bool keep_gathered_between_calls = true;
  MixedPrecision mixed_precision;
  // Which submodules are units; null: the root unit only.
  WrapPolicy wrap_policy;
  // What the optimizer steps (PyTorch FSDP's use_orig_params). true (the default, as in
  // FSDP2, which has only this mode): one tensor per parameter, in module order, under its
  // qualified name, as under every strategy: a trainable parameter as this rank's part of
  // its flattened elements, a 1-D view into the shard (the optimizer's update is the
  // shard's), empty when the rank holds none of it; a frozen parameter (in no unit; every
  // rank holds it whole) as itself, as DataParallel lists it. Each view's .grad shares the
  // shard's gradient after backward(), also when it was reset to undefined (LibTorch 2.x's
  // zero_grad()); optimizer state is per view. false: one flat fp32 shard per unit, which
  // mixes parameters (parameters() returns the shards, then the frozen parameters;
  // named_parameters() throws); the optimizer then makes one update per unit instead of one
  // per parameter. Memory and results are the same either way, and so are checkpoints
  // (optimizer state saved per parameter name). See docs/strategies.md, "Parameter groups".
  bool use_orig_params = true;
  // CPU offload (ZeRO-Offload's placement) for a module on an accelerator: the fp32 shards,
  // their gradients and therefore the optimizer's state live in host memory (pinned on
  // CUDA); parameters() returns those host tensors, so the optimizer steps on the CPU (use
  // dtrain::FusedAdamW, dtrain/fused_adamw.h). Each gather copies the shard to the device
  // first; each reduced gradient shard is copied back to host memory. Device memory then
  // holds only the gathered units, their unsharded gradients and the activations. Results
  // are bitwise those without offload. With the module on the CPU it changes nothing (the
  // shards are in host memory already). See docs/strategies.md, "CPU offload".
  bool cpu_offload = false;
  // Deferred initialisation (dtrain/deferred_init.h). Set: the module's parameters may be
  // deferred (defer_parameters: no memory), and each rank computes only its shard of each
  // unit, from each parameter's initial_value (seed and qualified name): the values
  // init_parameters(module, init) gives single-device or DDP training, for every sharding
  // strategy and world size, with no rank holding more than its shards plus one parameter.
  // Frozen parameters (in no unit) get their whole initial value; buffers are broadcast
  // from rank 0 as usual. Unset: the parameters' current values, rank 0's broadcast; a
  // deferred parameter is then an InvalidArgument.
  std::optional<DeferredInit> deferred_init;
  // Deprecated (one release more): give FSDP a 2-D DeviceMesh instead
  // (DeviceMeshOptions::shard_size). HYBRID_SHARD: communicators of this rank's shard group
  // (shard over it) and replicate group (all-reduce over it); see make_hybrid_groups.
  // Ignored by other strategies.
  CommunicatorPtr shard_group;
  CommunicatorPtr replicate_group;
  // Parameters' all-gathers quantised on the wire (ZeRO++'s qwZ; dtrain/quantization.h): each
  // rank sends its shard in bf16 or blockwise int8 and every rank computes with the
  // dequantised parameters (its own part included, so that all ranks compute alike). The fp32
  // shards the optimizer steps stay exact; only the compute copy carries the quantisation
  // error. int8 sends about a quarter of fp32's bytes (half of bf16 param_dtype's).
  Quantization quantize_params = Quantization::kNone;
  // Gradients' reduce-scatter quantised on the wire (ZeRO++'s qgZ): each rank sends every
  // peer the chunk that peer owns, in bf16 or blockwise int8; the owner dequantises the
  // chunks into fp32 and averages them there (its own chunk exact), so nothing is added up in
  // low precision. Traffic per rank: (world - 1) / world of the unit's gradient, quantised
  // (int8 about a quarter of fp32's reduce-scatter, int4 an eighth). With host_group, in two
  // levels (see host_group): inter-host traffic falls by the ranks per host once more. Over
  // HYBRID_SHARD's or NO_SHARD's replicas the all-reduce stays in the reduce dtype. Error
  // bound: docs/strategies.md, "Quantised communication".
  Quantization quantize_grads = Quantization::kNone;
  // Values per scale (quantize_params / quantize_grads int8 or int4); >= 1.
  int64_t quantization_block = kDefaultQuantizationBlock;
  // When ranks agree on a step's outcome (see StepChecks in dtrain/strategy.h).
  StepChecks step_checks = StepChecks::kAuto;
};

namespace detail {
struct Inspect;
}  // namespace detail

class FullyShardedDataParallel final : public Strategy {
 public:
  // Shards (or replicates) over `mesh` (dtrain/device_mesh.h): a 1-D mesh for FULL_SHARD,
  // SHARD_GRAD_OP and NO_SHARD, a 2-D one (replicate x shard) for HYBRID_SHARD; its host
  // groups, if any, serve ReshardAfterForward::kHost and two-level quantised gradients.
  // FsdpOptions::shard_group, replicate_group and host_group must then be unset.
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module, DeviceMesh mesh,
                           FsdpOptions options = {});
  // Over `comm` as a 1-D mesh; HYBRID_SHARD and the host group from the deprecated
  // FsdpOptions::shard_group, replicate_group and host_group (one release more).
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
                           FsdpOptions options = {});
  ~FullyShardedDataParallel() override;

  void backward(const at::Tensor& loss) override;
  // What the optimizer must step: the per-parameter views (FsdpOptions::use_orig_params,
  // the default), or one flat fp32 shard per unit. Build the
  // optimizer over these, not over model->parameters(): the module's own parameters are freed
  // between steps and get no gradient. A training forward throws InvalidArgument on every
  // rank saying so when neither this nor named_parameters() has been called and every unit
  // parameter of the module is referenced outside FSDP (what such an optimizer does).
  std::vector<at::Tensor> parameters() override;
  // The views with their parameters' names and full shapes (frozen parameters whole), as
  // under every strategy. With use_orig_params false, throws InvalidArgument (a flat shard
  // has no single parameter's name or shape).
  std::vector<NamedParameter> named_parameters() override;
  double grad_norm() override;
  at::Tensor grad_norm_tensor() override;
  int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state = {}) override;
  const StepStats& last_step_stats() const override;
  // Checkpoints: each parameter's slice is its part of this rank's fp32 shard (stepped as
  // the shard, or as its view with use_orig_params); frozen parameters and buffers are
  // replicated.
  StateLayout state_layout() override;
  void state_loaded() override;
  void finish() override;
  std::string name() const override { return "fsdp"; }
  // false: units gather their parameters only inside forward() (Strategy).
  bool module_runs_outside_forward() const override { return false; }
  int rank() const override;
  int world_size() const override;

  // Full (unsharded) parameters by qualified name, in module order, on rank 0; empty on
  // other ranks. Collective: every rank must call it. Loadable into the unwrapped model.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict();
  // This rank's shards with the metadata needed to reassemble them (unit, offsets, sizes):
  // "<unit>.flat_shard" (a copy of the fp32 shard), "<unit>.flat_meta" ([shard rank, shard
  // group size, numel, padded numel]) and "<unit>.param.<name>" ([offset, numel]) per unit.
  // Not collective. For another world size or strategy, use checkpoints (dtrain/checkpoint.h),
  // which reshard.
  std::vector<std::pair<std::string, at::Tensor>> sharded_state_dict();
  // Loads what sharded_state_dict() returned on this rank (the same module, units, sharding
  // and shard group): every unit's shard is copied back after its metadata is checked;
  // InvalidArgument naming the first entry that differs, is missing or is not FSDP's (nothing
  // is loaded then). Not collective: each rank loads its own. Between steps.
  void load_sharded_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state);

 protected:
  std::vector<at::Tensor> stepped_tensors() override;
  void begin_forward() override;
  void end_forward(at::Tensor& output) override;
  void forward_failed(std::exception_ptr error) noexcept override;

 private:
  friend struct detail::Inspect;  // tests' view of the schedule (src/strategy/inspect.h)
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- Where a unit runs ------------------------------------------------------------------

// Whether the backward of one call of a unit reads the unit's parameters: whether autograd
// saved them (or views of them) during the call's forward. Almost every layer does (a
// matmul's backward needs its weight), so FSDP gathers a unit again before each of its
// calls' backward.
enum class ParamsInBackward {
  kRead,
  // The call's backward needs none of the unit's parameters: an embedding lookup (its
  // backward needs only the indices), or a loss whose gradients were computed in forward
  // (gpt2::fused_lm_loss). Under FULL_SHARD / HYBRID_SHARD the unit then stays sharded from
  // the end of this call until its next forward: a tied embedding no longer sits gathered
  // through the whole backward. Should the backward read the parameters after all, it throws
  // InvalidArgument instead of computing with freed memory (the parameters' version counters
  // are bumped when they are freed, as an in-place write would). A unit called with kRead
  // earlier in the same forward may not be called with kNotRead (that earlier call's backward
  // would find its parameters modified): forward throws InvalidArgument.
  kNotRead,
};

// The tensors in a value a unit's forward returns: unit_call hooks each one that requires
// grad, so that the unit is gathered again before its backward whichever output's gradient
// arrives first. A customization point: provided for at::Tensor, std::tuple, std::pair,
// std::vector, std::array and std::optional of supported types, and arithmetic or enum
// values (no tensors). For a struct of your own, specialize it in namespace dtrain:
//
// clang-format off
//   struct EncoderOut { at::Tensor hidden; at::Tensor attention; int64_t layers; };
//   template <>
//   struct dtrain::UnitOutput<EncoderOut> {
//     template <typename F>
//     static void for_each_tensor(const EncoderOut& o, F&& f) { f(o.hidden); f(o.attention); }
//   };
// clang-format on
//
// List every tensor that can carry a gradient back into the unit: if the unit's backward
// started from an output left out, its parameters would not be gathered for it.
template <typename T, typename Enable = void>
struct UnitOutput {
  static_assert(sizeof(T) == 0,
                "dtrain::unit_call: this return type has no dtrain::UnitOutput<T>; specialize "
                "it to list the type's tensors (see dtrain/fsdp.h)");
};

// ---- UnitOutput for the standard types ----

template <>
struct UnitOutput<at::Tensor> {
  template <typename F>
  static void for_each_tensor(const at::Tensor& t, F&& f) {
    f(t);
  }
};

template <typename T>
struct UnitOutput<T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>>> {
  template <typename F>
  static void for_each_tensor(const T&, F&&) {}
};

template <typename... Ts>
struct UnitOutput<std::tuple<Ts...>> {
  template <typename F>
  static void for_each_tensor(const std::tuple<Ts...>& t, F&& f) {
    std::apply([&](const Ts&... e) { (UnitOutput<Ts>::for_each_tensor(e, f), ...); }, t);
  }
};

template <typename A, typename B>
struct UnitOutput<std::pair<A, B>> {
  template <typename F>
  static void for_each_tensor(const std::pair<A, B>& p, F&& f) {
    UnitOutput<A>::for_each_tensor(p.first, f);
    UnitOutput<B>::for_each_tensor(p.second, f);
  }
};

template <typename T>
struct UnitOutput<std::vector<T>> {
  template <typename F>
  static void for_each_tensor(const std::vector<T>& v, F&& f) {
    for (const T& e : v) UnitOutput<T>::for_each_tensor(e, f);
  }
};

template <typename T, size_t N>
struct UnitOutput<std::array<T, N>> {
  template <typename F>
  static void for_each_tensor(const std::array<T, N>& a, F&& f) {
    for (const T& e : a) UnitOutput<T>::for_each_tensor(e, f);
  }
};

template <typename T>
struct UnitOutput<std::optional<T>> {
  template <typename F>
  static void for_each_tensor(const std::optional<T>& o, F&& f) {
    if (o) UnitOutput<T>::for_each_tensor(*o, f);
  }
};

namespace detail {
// unit_call's part that does not depend on the return type: runs `fn` as `module`'s forward;
// `fn` appends the output's tensors to its argument.
void run_unit(torch::nn::Module& module, ParamsInBackward params_in_backward,
              const std::function<void(std::vector<at::Tensor>& outputs)>& fn);
}  // namespace detail

// Runs `fn` as the forward of `module` and returns what it returns. Under
// FullyShardedDataParallel, when `module` is a unit, its parameters are gathered before and
// freed after (per the sharding strategy) and every output tensor (UnitOutput) is hooked
// for the pre-backward gather. Everywhere else it just calls fn().
//
// Needed where a unit's forward is called by the model's own code: through a typed handle
// (`block->forward(x)`), or an entry of a torch::nn::ModuleList or ModuleDict reached with
// `->as<T>()` — such calls are bound at compile time to T::forward and C++ modules have no
// forward hooks, so FSDP cannot see them. Not needed for entries of a torch::nn::Sequential
// run by Sequential::forward: FSDP routes those itself (see the top of this header).
// `params_in_backward`: see ParamsInBackward; kNotRead only where this call's backward
// provably reads none of the unit's parameters.
template <typename Fn>
auto unit_call(torch::nn::Module& module, Fn&& fn,
               ParamsInBackward params_in_backward = ParamsInBackward::kRead)
    -> std::decay_t<std::invoke_result_t<Fn&>> {
  using Out = std::decay_t<std::invoke_result_t<Fn&>>;
  static_assert(!std::is_void_v<Out>, "dtrain::unit_call: the unit's forward must return a value");
  std::optional<Out> out;
  detail::run_unit(module, params_in_backward, [&](std::vector<at::Tensor>& tensors) {
    out.emplace(fn());
    UnitOutput<Out>::for_each_tensor(*out, [&](const at::Tensor& t) { tensors.push_back(t); });
  });
  return std::move(*out);
}

}  // namespace dtrain

// FullyShardedDataParallel: the façade. It turns the options into groups and dtypes, builds
// the units (fsdp/unit_plan.h, fsdp/flat_param.h) into a schedule (fsdp/schedule.h) and runs a
// step through it between the step agreements (strategy/step_sync.h) that keep every rank's
// collectives in step when one of them fails.
#include "dtrain/fsdp.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <string>

#include <fmt/format.h>

#include "amp/bf16_check.h"
#include "compat/autocast.h"
#include "compat/autograd_errors.h"
#include "compress/quantized_reduce_scatter.h"
#include "dtrain/errors.h"
#include "fsdp/active.h"
#include "fsdp/fsdp_impl.h"
#include "fsdp/unit_plan.h"
#include "strategy/inspect.h"
#include "strategy/module_sync.h"

namespace dtrain {

using Clock = std::chrono::steady_clock;

namespace {

// FsdpOptions::reshard_after_forward resolved against the sharding strategy. The strategy
// says whether parameters are freed after forward; reshard_after_forward only says where
// FULL_SHARD's and HYBRID_SHARD's go (kAll, kHost). A setting that turns one strategy into
// another (FULL_SHARD + kNone is SHARD_GRAD_OP, SHARD_GRAD_OP + kAll is FULL_SHARD) is the
// same choice made twice: accepted for one release more, with a warning naming the spelling
// to use.
ReshardAfterForward after_forward(const FsdpOptions& options, const ErrorContext& ctx) {
  const bool frees = options.sharding == ShardingStrategy::kFullShard ||
                     options.sharding == ShardingStrategy::kHybridShard;
  if (!options.reshard_after_forward) {
    return frees ? ReshardAfterForward::kAll : ReshardAfterForward::kNone;
  }
  const ReshardAfterForward want = *options.reshard_after_forward;
  if (options.sharding == ShardingStrategy::kNoShard && want != ReshardAfterForward::kNone) {
    throw InvalidArgument(ctx,
                          "NO_SHARD keeps every parameter: reshard_after_forward must be "
                          "unset or kNone");
  }
  // One warning per job, from rank 0.
  if (frees && want == ReshardAfterForward::kNone && ctx.rank == 0) {
    TORCH_WARN(
        "dtrain FSDP: reshard_after_forward kNone with FULL_SHARD is SHARD_GRAD_OP (HYBRID_SHARD: "
        "_HYBRID_SHARD_ZERO2 in PyTorch); this spelling is deprecated, set "
        "ShardingStrategy::kShardGradOp instead (docs/strategies.md, \"Sharding options\")");
  }
  if (options.sharding == ShardingStrategy::kShardGradOp && want != ReshardAfterForward::kNone &&
      ctx.rank == 0) {
    TORCH_WARN(
        "dtrain FSDP: SHARD_GRAD_OP keeps parameters after forward; reshard_after_forward kAll "
        "or kHost makes it FULL_SHARD. This spelling is deprecated: set "
        "ShardingStrategy::kFullShard with that reshard_after_forward instead "
        "(docs/strategies.md, \"Sharding options\")");
  }
  return want;
}

// The deprecated FsdpOptions groups as a mesh over `comm`.
DeviceMesh mesh_from_options(const CommunicatorPtr& comm, const FsdpOptions& o) {
  if (!comm) throw InvalidArgument("FullyShardedDataParallel: communicator is null");
  if (o.sharding != ShardingStrategy::kHybridShard) {
    return DeviceMesh::from_groups(comm, nullptr, nullptr, o.host_group);
  }
  if (!o.shard_group || !o.replicate_group) {
    throw InvalidArgument(
        ErrorContext{comm->rank(), comm->world_size(), "FullyShardedDataParallel()", -1},
        "HYBRID_SHARD needs a 2-D mesh (DeviceMesh::create with DeviceMeshOptions::shard_size) "
        "or FsdpOptions::shard_group and replicate_group (see make_hybrid_groups)");
  }
  return DeviceMesh::from_groups(comm, o.shard_group, o.replicate_group, o.host_group);
}

// The options without the groups mesh_from_options took (a copy: the constructor's other
// argument reads the same options, in an unspecified order).
FsdpOptions without_groups(const FsdpOptions& options) {
  FsdpOptions o = options;
  o.shard_group = nullptr;
  o.replicate_group = nullptr;
  o.host_group = nullptr;
  return o;
}

CommunicatorPtr checked(CommunicatorPtr comm, const std::shared_ptr<torch::nn::Module>& module,
                        const FsdpOptions& o) {
  const ErrorContext ctx{comm->rank(), comm->world_size(), "FullyShardedDataParallel()", -1};
  if (!module) throw InvalidArgument(ctx, "module is null");
  if (o.limit_all_gathers < 1) throw InvalidArgument(ctx, "limit_all_gathers must be >= 1");
  return comm;
}

fsdp::UnitComms make_comms(const DeviceMesh& mesh, const FsdpOptions& options,
                           const ErrorContext& ctx) {
  if (options.shard_group || options.replicate_group || options.host_group) {
    throw InvalidArgument(ctx,
                          "the groups are given twice: with a DeviceMesh, leave "
                          "FsdpOptions::shard_group, replicate_group and host_group unset");
  }
  const CommunicatorPtr& comm = mesh.world();
  fsdp::UnitComms c;
  c.rank = comm->rank();
  c.world_size = comm->world_size();
  if (options.sharding != ShardingStrategy::kHybridShard && mesh.ndim() == 2) {
    throw InvalidArgument(ctx,
                          "a 2-D mesh (replicate x shard) is HYBRID_SHARD's: set "
                          "ShardingStrategy::kHybridShard, or pass a 1-D mesh");
  }
  switch (options.sharding) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      if (comm->world_size() > 1) c.shard = comm;
      break;
    case ShardingStrategy::kNoShard:
      if (comm->world_size() > 1) c.replicate = comm;
      break;
    case ShardingStrategy::kHybridShard:
      if (mesh.ndim() != 2) {
        throw InvalidArgument(ctx,
                              "HYBRID_SHARD needs a 2-D mesh (DeviceMesh::create with "
                              "DeviceMeshOptions::shard_size)");
      }
      if (mesh.shard_group()->world_size() > 1) c.shard = mesh.shard_group();
      if (mesh.replicate_group()->world_size() > 1) c.replicate = mesh.replicate_group();
      break;
  }
  const CommunicatorPtr& host_group = mesh.host_group();
  const auto param_dtype = options.mixed_precision.param_dtype.value_or(at::kFloat);
  c.reduce_dtype = options.mixed_precision.reduce_dtype.value_or(param_dtype);
  if (options.quantization_block < 1) {
    throw InvalidArgument(
        ctx, "quantization_block must be >= 1, got " + std::to_string(options.quantization_block));
  }
  c.quantize_params = options.quantize_params;
  c.quantize_grads = options.quantize_grads;
  c.quantization_block = options.quantization_block;
  if (c.shard && after_forward(options, ctx) == ReshardAfterForward::kHost) {
    if (!host_group) {
      throw InvalidArgument(ctx,
                            "reshard_after_forward kHost needs FsdpOptions::host_group (the "
                            "ranks of this host; see make_host_group) or a mesh with host "
                            "groups (DeviceMeshOptions::local_world_size)");
    }
    c.host_size = host_group->world_size();
    c.host_rank = host_group->rank();
    if (c.shard->world_size() % c.host_size != 0) {
      throw InvalidArgument(
          ctx, fmt::format("reshard_after_forward kHost: the host group's {} ranks must divide the "
                           "shard group's {}",
                           c.host_size, c.shard->world_size()));
    }
    if (c.host_size > 1) c.host = host_group;
  }
  // Quantised gradients go in two levels where the host group is a proper part of the
  // shard group: each value then crosses hosts once, as its host's sum.
  if (c.shard && c.quantize_grads != Quantization::kNone && host_group &&
      host_group->world_size() > 1 && host_group->world_size() < c.shard->world_size()) {
    detail::check_host_layout(*c.shard, *host_group);
    c.grad_host = host_group;
  }
  return c;
}

}  // namespace

FullyShardedDataParallel::Impl::Impl(std::shared_ptr<torch::nn::Module> module,
                                     const DeviceMesh& mesh, FsdpOptions options)
    : comm_(checked(mesh.world(), module, options)),
      module_(std::move(module)),
      options_(std::move(options)),
      comms_(make_comms(mesh, options_, ctx("FullyShardedDataParallel()"))),
      driver_("FullyShardedDataParallel", comm_, options_.step_checks,
              {comm_, comms_.shard, comms_.replicate, comms_.host, comms_.grad_host}, *this) {
  if (comms_.shard) {
    shard_size_ = comms_.shard->world_size();
    shard_rank_ = comms_.shard->rank();
  }
  param_dtype_ = options_.mixed_precision.param_dtype.value_or(at::kFloat);
  // One warning per job, not per rank.
  const auto params = module_->parameters(true);
  if (param_dtype_ == at::kBFloat16 && comm_->rank() == 0 && !params.empty() &&
      params.front().device().is_cpu()) {
    amp::warn_if_bf16_emulated(options_.mixed_precision.cpu_check, "FullyShardedDataParallel");
  }
  if (param_dtype_ != at::kFloat && options_.mixed_precision.cast_forward_inputs) {
    const auto device = params.empty() ? c10::DeviceType::CPU : params.front().device().type();
    // ATen autocasts CPU to bf16 only, and only CPU and CUDA.
    if ((device == c10::DeviceType::CPU && param_dtype_ == at::kBFloat16) ||
        device == c10::DeviceType::CUDA) {
      compat::AutocastState a;  // the other device type's fields: the caller's, at entry
      if (device == c10::DeviceType::CPU) {
        a.cpu = true;
        a.cpu_dtype = param_dtype_;
      } else {
        a.cuda = true;
        a.cuda_dtype = param_dtype_;
      }
      forward_autocast_ = a;
    }
  }
  fsdp::ScheduleOptions so;
  so.after_forward = after_forward(options_, ctx("FullyShardedDataParallel()"));
  so.backward_prefetch = options_.backward_prefetch;
  so.forward_prefetch = options_.forward_prefetch;
  so.limit_all_gathers = options_.limit_all_gathers;
  so.keep_gathered_between_calls = options_.keep_gathered_between_calls;
  schedule_ = std::make_unique<fsdp::Schedule>(so, comms_, driver_.failure());

  const auto& deferred = options_.deferred_init;
  if (deferred && !deferred->init) {
    throw InvalidArgument(ctx("FullyShardedDataParallel()"),
                          "FsdpOptions::deferred_init has no init function");
  }
  for (const auto& item : module_->named_parameters(true)) {
    if (!deferred && is_deferred(item.value())) {
      throw InvalidArgument(ctx("FullyShardedDataParallel()"),
                            "parameter '" + item.key() +
                                "' is deferred (dtrain::defer_parameters: no memory); set "
                                "FsdpOptions::deferred_init to materialise it");
    }
  }
  // With deferred_init every rank computes the same initial parameter values.
  agree_on_initial_state(*comm_, *module_, "FullyShardedDataParallel()",
                         /*broadcast_parameters=*/!deferred);
  if (deferred) {
    // Frozen parameters belong to no unit: each rank keeps the whole initial value.
    for (const auto& item : module_->named_parameters(true)) {
      if (!item.value().requires_grad()) init_parameter(item.key(), item.value(), *deferred);
    }
  }
  build_units();
  cast_buffers();
}

void FullyShardedDataParallel::Impl::record_param_refs() { param_refs_ = unit_param_refs(); }

void FullyShardedDataParallel::Impl::cast_buffers() {
  const auto dtype = options_.mixed_precision.buffer_dtype;
  if (!dtype) return;
  c10::NoGradGuard no_grad;
  for (const auto& item : module_->named_buffers(true)) {
    at::Tensor b = item.value();
    if (!b.is_floating_point() || b.scalar_type() == *dtype) continue;
    buffer_dtypes_.emplace(item.key(), b.scalar_type());
    b.set_data(b.to(*dtype));
  }
}

FullyShardedDataParallel::Impl::~Impl() {
  if (fsdp::active_schedule() == schedule_.get()) fsdp::set_active_schedule(nullptr);
}

namespace {

// Parameters of modules with fp32 running statistics of their own (BatchNorm, SyncBatchNorm,
// InstanceNorm with track_running_stats; judged by a floating-point "running_mean" buffer,
// in buffer_dtype once cast): with a lower param_dtype they compute in fp32, since ATen's
// batch_norm takes a low-precision input only with fp32 weight, bias and statistics.
std::set<const c10::TensorImpl*> fp32_norm_params(const torch::nn::Module& root,
                                                  const MixedPrecision& mp) {
  std::set<const c10::TensorImpl*> out;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const torch::nn::Module& m = *item.value();
    const auto buffers = m.named_buffers(/*recurse=*/false);
    const at::Tensor* stats = buffers.find("running_mean");
    if (stats == nullptr || !stats->defined() || !stats->is_floating_point()) continue;
    if (mp.buffer_dtype.value_or(stats->scalar_type()) != at::kFloat) continue;
    for (const auto& p : m.parameters(/*recurse=*/false)) {
      if (p.defined()) out.insert(p.unsafeGetTensorImpl());
    }
  }
  return out;
}

}  // namespace

void FullyShardedDataParallel::Impl::build_units() {
  c10::NoGradGuard no_grad;
  const auto fp32_params = fp32_norm_params(*module_, options_.mixed_precision);
  std::set<const torch::nn::Module*> submodules;
  auto plans = fsdp::plan_units(module_, options_.wrap_policy);
  if (options_.wrap_policy && plans.size() == 1) {
    // Usually a type name that is not the module's name() (LibTorch records "BlockImpl" for
    // a TORCH_MODULE(Block)); silently the whole model would be gathered for every forward.
    throw InvalidArgument(
        ctx("FullyShardedDataParallel()"),
        "the wrap policy matched no submodule, so the model would be one unit (the root, "
        "gathered whole for every forward); fix the policy (wrap_modules_named matches "
        "Module::name(), e.g. \"BlockImpl\" for a TORCH_MODULE(Block)) or leave "
        "FsdpOptions::wrap_policy unset for a root-only FSDP");
  }
  for (auto& plan : plans) {
    if (plan.module != module_.get()) submodules.insert(plan.module);
    std::vector<char> fp32_compute;
    for (const auto& p : plan.params) {
      fp32_compute.push_back(static_cast<char>(fp32_params.count(p.unsafeGetTensorImpl())));
    }
    fsdp::FlatParam flat(
        std::move(plan.params), std::move(plan.param_names),
        fsdp::FlatParamOptions{shard_size_, shard_rank_, param_dtype_, options_.use_orig_params,
                               &buffer_pool_, options_.cpu_offload,
                               options_.deferred_init ? &*options_.deferred_init : nullptr,
                               std::move(fp32_compute)});
    schedule_->add_unit(std::move(plan.name), plan.module, std::move(flat));
  }
  sequential_units_ = std::make_unique<fsdp::SequentialUnits>(module_, submodules, schedule_.get());
  // Units list parameters unit by unit; the optimizer sees them in module order, as under
  // the other strategies. Frozen parameters are in no unit: every rank holds them whole, and
  // they are listed as themselves, as DataParallel lists them.
  std::map<std::string, NamedParameter> by_name;
  if (options_.use_orig_params) {
    for (size_t k = 0; k < schedule_->num_units(); ++k) {
      const fsdp::FlatParam& f = schedule_->unit(k).flat();
      for (size_t i = 0; i < f.num_params(); ++i) {
        by_name[f.name(i)] = NamedParameter{f.name(i), f.shard_view(i), f.param(i).sizes().vec()};
      }
    }
  }
  for (const auto& item : module_->named_parameters(true)) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) {
      frozen_.push_back(p);
      if (options_.use_orig_params)
        views_.push_back(NamedParameter{item.key(), p, p.sizes().vec()});
      continue;
    }
    auto it = by_name.find(item.key());
    if (it != by_name.end()) views_.push_back(it->second);
  }
}

std::vector<NamedParameter> FullyShardedDataParallel::Impl::named_parameters() const {
  shards_handed_out_ = true;
  if (!options_.use_orig_params) {
    throw InvalidArgument(ctx("named_parameters"),
                          "FSDP steps one flat shard per unit, which mixes parameters: set "
                          "FsdpOptions::use_orig_params for per-parameter tensors");
  }
  return views_;
}

std::vector<at::Tensor> FullyShardedDataParallel::Impl::parameters() const {
  shards_handed_out_ = true;
  return stepped();
}

std::vector<at::Tensor> FullyShardedDataParallel::Impl::stepped() const {
  std::vector<at::Tensor> out;
  if (options_.use_orig_params) {
    for (const auto& v : views_) out.push_back(v.tensor);
    return out;
  }
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    out.push_back(schedule_->unit(k).flat().shard());
  }
  out.insert(out.end(), frozen_.begin(), frozen_.end());
  return out;
}

// --- a step ---

std::vector<int64_t> FullyShardedDataParallel::Impl::unit_param_refs() const {
  std::vector<int64_t> refs;
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    const fsdp::FlatParam& f = schedule_->unit(k).flat();
    for (size_t i = 0; i < f.num_params(); ++i) {
      refs.push_back(static_cast<int64_t>(f.param(i).use_count()));
    }
  }
  return refs;
}

std::exception_ptr FullyShardedDataParallel::Impl::check_optimizer_parameters() const {
  if (shards_handed_out_ || param_refs_.empty()) return nullptr;
  // Stops at the first parameter not held elsewhere: a loop without optimizer pays for one.
  size_t n = 0;
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    const fsdp::FlatParam& f = schedule_->unit(k).flat();
    for (size_t i = 0; i < f.num_params(); ++i, ++n) {
      if (static_cast<int64_t>(f.param(i).use_count()) <= param_refs_[n]) return nullptr;
    }
  }
  return std::make_exception_ptr(InvalidArgument(
      ctx("forward"),
      "every parameter of the module is held outside FSDP, and parameters() was never "
      "called: is the optimizer built over model->parameters()? FSDP frees the module's own "
      "parameters between steps and gives them no gradient, so such an optimizer trains "
      "nothing. Build it over strategy->parameters() (or strategy->named_parameters() for "
      "parameter groups), as under every strategy"));
}

void FullyShardedDataParallel::Impl::begin_forward(bool gradient_sync) {
  fsdp::Schedule* active = fsdp::active_schedule();
  if (active != nullptr && active != schedule_.get()) {
    throw InvalidArgument(ctx("forward"), "another FSDP forward is running on this thread");
  }
  // A misuse found before any collective ends the step on every rank.
  driver_.begin_forward(gradient_sync,
                        c10::GradMode::is_enabled() ? check_optimizer_parameters() : nullptr);
  fsdp::set_active_schedule(schedule_.get());
  enter_forward_autocast();
}

void FullyShardedDataParallel::Impl::start_forward(bool /*training*/, bool gradient_sync) {
  schedule_->set_gradient_sync(gradient_sync);
  for (size_t i = 0; i < schedule_->num_units(); ++i) {
    schedule_->unit(i).flat().release_unshared_shard_grad();
  }
  schedule_->begin_step();
  try {
    schedule_->begin_forward();
  } catch (...) {
    break_step("gathering the root unit failed");
  }
}

void FullyShardedDataParallel::Impl::enter_forward_autocast() {
  if (!forward_autocast_) return;
  // Only this thread's autocast flags and dtypes change; the ones of the caller's own region
  // (if any) come back in leave_forward_autocast().
  compat::AutocastState want = *forward_autocast_;
  const compat::AutocastState now = compat::AutocastState::current();
  if (want.cpu) {
    want.cuda = now.cuda;
    want.cuda_dtype = now.cuda_dtype;
  } else {
    want.cpu = now.cpu;
    want.cpu_dtype = now.cpu_dtype;
  }
  autocast_saved_ = compat::enter_autocast(want);
}

void FullyShardedDataParallel::Impl::leave_forward_autocast() {
  if (!autocast_saved_) return;
  compat::leave_autocast(*autocast_saved_);
  autocast_saved_.reset();
}

void FullyShardedDataParallel::Impl::end_forward() {
  leave_forward_autocast();
  fsdp::set_active_schedule(nullptr);
  driver_.end_forward();
}

void FullyShardedDataParallel::Impl::end_forward(bool /*training*/) {
  schedule_->end_forward(*comm_);
}

void FullyShardedDataParallel::Impl::backward(const at::Tensor& loss, bool gradient_sync) {
  driver_.check_usable("backward");
  if (!schedule_->order_recorded()) {
    throw InvalidArgument(ctx("backward"), "backward() before any forward() through the strategy");
  }
  driver_.backward(loss, gradient_sync);
}

std::exception_ptr FullyShardedDataParallel::Impl::run_backward(const at::Tensor& loss,
                                                                bool gradient_sync) {
  fsdp::Schedule& s = *schedule_;
  s.set_gradient_sync(gradient_sync);
  return s.backward(
      [&] {
        try {
          loss.backward();
        } catch (const c10::Error& e) {
          // What a version bump of ParamsInBackward::kNotRead (fsdp/schedule.cpp) looks like.
          if (!s.has_unread_calls() || !compat::is_saved_tensor_modified(e)) throw;
          throw InvalidArgument(
              ctx("backward"),
              "backward read the parameters of a unit called with ParamsInBackward::kNotRead, "
              "which were freed after its forward (autograd saved them); call it with kRead "
              "(the default). LibTorch: " +
                  std::string(e.what_without_backtrace()));
        }
      },
      comm_->world_size());
}

void FullyShardedDataParallel::Impl::commit_backward(bool /*gradient_sync*/) {
  schedule_->commit_backward();
}

// --- failures ---

void FullyShardedDataParallel::Impl::forward_failed(std::exception_ptr error) {
  leave_forward_autocast();
  fsdp::set_active_schedule(nullptr);
  driver_.forward_failed(std::move(error));
}

void FullyShardedDataParallel::Impl::issue_as_peers_do(bool training, bool /*gradient_sync*/) {
  schedule_->issue_as_peers_do(training, comm_->world_size());
}

// Unit states must match the peers' for the next step, also after a failed evaluation.
void FullyShardedDataParallel::Impl::reset_after_failure(bool /*training*/) noexcept {
  schedule_->reset();
}

void FullyShardedDataParallel::Impl::finish() {
  if (fsdp::active_schedule() == schedule_.get()) fsdp::set_active_schedule(nullptr);
  driver_.finish();
}

// --- public wrapper ---

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   DeviceMesh mesh, FsdpOptions options)
    : impl_(std::make_unique<Impl>(std::move(module), mesh, std::move(options))) {
  // Here, not in Impl's constructor: its locals held every parameter until it returned.
  impl_->record_param_refs();
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   CommunicatorPtr comm, FsdpOptions options)
    : FullyShardedDataParallel(std::move(module), mesh_from_options(comm, options),
                               without_groups(options)) {}
FullyShardedDataParallel::~FullyShardedDataParallel() = default;

void FullyShardedDataParallel::begin_forward() { impl_->begin_forward(requires_gradient_sync()); }
void FullyShardedDataParallel::end_forward(at::Tensor& /*output*/) { impl_->end_forward(); }
void FullyShardedDataParallel::forward_failed(std::exception_ptr error) noexcept {
  impl_->forward_failed(std::move(error));
}
void FullyShardedDataParallel::finish() { impl_->finish(); }
void FullyShardedDataParallel::backward(const at::Tensor& loss) {
  impl_->backward(loss, requires_gradient_sync());
}
std::vector<at::Tensor> FullyShardedDataParallel::parameters() { return impl_->parameters(); }
std::vector<at::Tensor> FullyShardedDataParallel::stepped_tensors() { return impl_->stepped(); }
std::vector<NamedParameter> FullyShardedDataParallel::named_parameters() {
  return impl_->named_parameters();
}
double FullyShardedDataParallel::grad_norm() { return grad_norm_tensor().item<double>(); }
at::Tensor FullyShardedDataParallel::grad_norm_tensor() { return impl_->grad_norm(); }
int64_t FullyShardedDataParallel::model_state_bytes(
    const std::vector<at::Tensor>& optimizer_state) {
  return impl_->model_state_bytes(optimizer_state);
}
const StepStats& FullyShardedDataParallel::last_step_stats() const {
  return impl_->last_step_stats();
}
int FullyShardedDataParallel::rank() const { return impl_->comm()->rank(); }
int FullyShardedDataParallel::world_size() const { return impl_->comm()->world_size(); }
std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::full_state_dict() {
  return impl_->full_state_dict();
}
std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::sharded_state_dict() {
  return impl_->sharded_state_dict();
}
void FullyShardedDataParallel::load_sharded_state_dict(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  impl_->load_sharded_state_dict(state);
}
StateLayout FullyShardedDataParallel::state_layout() { return impl_->state_layout(); }
void FullyShardedDataParallel::state_loaded() { impl_->state_loaded(); }

namespace detail {

std::vector<std::string> Inspect::last_collective_log(const FullyShardedDataParallel& fsdp) {
  return fsdp.impl_->schedule().log();
}
std::vector<std::string> Inspect::unit_order(const FullyShardedDataParallel& fsdp) {
  return fsdp.impl_->schedule().order_names();
}

}  // namespace detail

}  // namespace dtrain

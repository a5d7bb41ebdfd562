// FullyShardedDataParallel. One Unit per group of parameters gathered and freed together;
// the module's own parameter tensors are views into the unit's flat buffer, whose memory is
// released between uses (the storage object stays, so autograd's saved tensors see the
// memory again once it is re-gathered before backward).
#include "dtrain/fsdp.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "compat/torch_compat.h"
#include "dtrain/errors.h"
#include "strategy/module_sync.h"
#include "strategy/state_layout.h"
#include "strategy/step_sync.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

// The FSDP instance whose forward is running on this thread: how unit_call finds it
// without any process-wide state. Set only inside Strategy::forward.
thread_local FullyShardedDataParallel::Impl* t_active = nullptr;

}  // namespace

class FullyShardedDataParallel::Impl {
 public:
  Impl(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm, FsdpOptions options);
  ~Impl();

  void begin_forward();
  void end_forward(at::Tensor& output);
  void forward_failed(std::exception_ptr error);
  void finish();
  at::Tensor unit_call(torch::nn::Module& module, const std::function<at::Tensor()>& fn);
  void backward(const at::Tensor& loss);
  double grad_norm();
  int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state);
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict();
  std::vector<std::pair<std::string, at::Tensor>> sharded_state_dict();
  StateLayout state_layout();
  void state_loaded();

  CommunicatorPtr comm_;
  StepStats stats_;
  std::vector<at::Tensor> shards_;
  std::vector<std::string> log_;
  std::vector<std::string> order_names_;
  mutable std::mutex mu_;

 private:
  // Where a unit's parameters are (FSDP2's ShardedState).
  //   kSharded:   only the fp32 shard is current; `full` has no memory (sharded) or stale
  //               contents (unsharded configurations, refreshed at the next unshard).
  //   kGathering: an all-gather into `full` is in flight.
  //   kUnsharded: `full` holds the current parameters; the module computes with them.
  // Moves: unshard() kSharded -> kGathering (-> kUnsharded without a shard group),
  // wait_unsharded() kGathering -> kUnsharded, reshard() kUnsharded -> kSharded.
  enum class ParamState { kSharded, kGathering, kUnsharded };
  // Where a unit's gradient is within backward.
  //   kIdle:         no backward in progress.
  //   kAccumulating: backward armed; `pending` parameters still wait for their gradient.
  //   kReducing:     flattened and reduce-scattered (in flight).
  //   kReduced:      the averaged shard gradient is in reduce_out, to be added to the
  //                  shard's .grad once every rank agreed the step succeeded.
  // Moves: arm() kIdle -> kAccumulating, launch_reduction() kAccumulating -> kReducing,
  // complete_reduction() kReducing -> kReduced, accumulate() kReduced -> kIdle.
  // reset() (a failed step) takes any unit to SHARDED / IDLE, dropping its gradient.
  enum class GradState { kIdle, kAccumulating, kReducing, kReduced };

  struct Unit {
    std::string name;
    const torch::nn::Module* module = nullptr;
    std::vector<at::Tensor> params;
    std::vector<std::string> param_names;
    std::vector<int64_t> offsets;
    int64_t numel = 0, padded = 0, shard_numel = 0;
    at::Tensor full;   // compute dtype, `padded` elements; memory released when sharded
    at::Tensor shard;  // fp32 master shard, a leaf the optimizer steps
    ParamState state = ParamState::kUnsharded;
    WorkPtr gather_work;      // kGathering only
    at::Tensor gather_input;  // kept alive while gather_work runs
    GradState grad = GradState::kIdle;
    int pending = 0;       // kAccumulating: parameters whose gradient has not arrived
    WorkPtr reduce_work;   // kReducing: the reduce-scatter (null without a shard group)
    at::Tensor reduce_out;  // kReducing / kReduced
    std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
    bool ran = false;
  };

  static const char* state_name(ParamState s);
  static const char* state_name(GradState s);
  // Invariant of a transition: the unit must be in one of `from`; anything else is a bug in
  // this file, reported by name instead of surfacing later as a hang or wrong numbers.
  void expect(const Unit& u, const char* transition, ParamState from);
  void expect(const Unit& u, const char* transition, GradState from);

  ErrorContext ctx(const char* op) const {
    return ErrorContext{comm_->rank(), comm_->world_size(), op, -1};
  }
  bool sharded() const { return shard_size_ > 1; }
  bool frees_after_forward() const {
    return options_.sharding == ShardingStrategy::kFullShard ||
           options_.sharding == ShardingStrategy::kHybridShard;
  }
  void build_units();
  // The transitions (see ParamState / GradState).
  void unshard(Unit& u, const char* why);
  void wait_unsharded(Unit& u);
  void reshard(Unit& u);
  void arm(Unit& u);
  void launch_reduction(Unit& u);
  void complete_reduction(Unit& u);
  void accumulate(Unit& u);
  void reset(Unit& u);
  // unshard() unless already under way, then wait: what a unit needs before it computes.
  void ensure_unsharded(Unit& u);
  // reshard() whatever the state; a gather in flight is waited for first.
  void reshard_any(Unit& u);
  void prefetch(int index, const char* why);
  void pre_backward(int position);
  void on_grad_ready(int index);
  void launch_ready_reductions();

  // Failures. A collective of the step as another rank issues it, for replaying.
  struct Issued {
    enum Kind { kAllGather, kReduceScatter, kAllReduce } kind;
    int unit;
    bool operator==(const Issued& o) const { return kind == o.kind && unit == o.unit; }
  };
  void issued(Issued::Kind kind, const Unit& u);
  // Issues, with dummy buffers, what another rank whose forward succeeded still issues in this
  // step: the rest of the forward (from the unit order) and all of backward (from the last
  // backward's log), so that every rank reaches the end-of-backward agreement.
  void finish_forward_as_peers_do();
  void replay(const std::vector<Issued>& ops, size_t from);
  // Runs one of this file's collective steps; an exception from it means this rank's
  // collectives may no longer match its peers'.
  template <typename Fn>
  void collective(Fn&& fn);
  void reset_after_failure();
  int index_of(const torch::nn::Module& m) const;
  void record(const std::string& entry) { log_.push_back(entry); }

  std::shared_ptr<torch::nn::Module> module_;
  FsdpOptions options_;
  CommunicatorPtr shard_comm_;      // null when shard_size_ == 1
  CommunicatorPtr replicate_comm_;  // null when there is no replication
  int shard_size_ = 1, shard_rank_ = 0;
  c10::ScalarType param_dtype_ = at::kFloat, reduce_dtype_ = at::kFloat;

  std::vector<Unit> units_;  // units_[0] is the root
  std::map<const torch::nn::Module*, int> unit_of_module_;
  std::shared_ptr<Impl*> token_;

  // Execution order: unit indices in forward order (recorded each iteration, compared with
  // the first); reductions launch in the reverse order, root last.
  std::vector<int> forward_order_, recorded_order_;
  std::vector<int> reduce_order_;
  size_t next_reduce_ = 0;
  bool armed_ = false;
  Clock::time_point first_reduce_;

  StepSync steps_;
  bool training_forward_ = false;  // the running forward() has grad mode on
  bool in_backward_ = false;       // collectives issued now are logged in backward_log_
  bool schedule_failed_ = false;   // one of this file's collectives or invariants failed
  std::vector<Issued> backward_log_, last_backward_log_;
};

FullyShardedDataParallel::Impl::Impl(std::shared_ptr<torch::nn::Module> module,
                                     CommunicatorPtr comm, FsdpOptions options)
    : comm_(std::move(comm)),
      module_(std::move(module)),
      options_(std::move(options)),
      steps_(comm_, "FullyShardedDataParallel", c10::Device(c10::kCPU)) {
  if (!comm_) throw InvalidArgument("FullyShardedDataParallel: communicator is null");
  if (!module_) throw InvalidArgument(ctx("FullyShardedDataParallel()"), "module is null");
  if (options_.limit_all_gathers < 1) {
    throw InvalidArgument(ctx("FullyShardedDataParallel()"), "limit_all_gathers must be >= 1");
  }
  switch (options_.sharding) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      if (comm_->world_size() > 1) shard_comm_ = comm_;
      break;
    case ShardingStrategy::kNoShard:
      if (comm_->world_size() > 1) replicate_comm_ = comm_;
      break;
    case ShardingStrategy::kHybridShard:
      if (!options_.shard_group || !options_.replicate_group) {
        throw InvalidArgument(ctx("FullyShardedDataParallel()"),
                              "HYBRID_SHARD needs FsdpOptions::shard_group and replicate_group "
                              "(see make_hybrid_groups)");
      }
      if (options_.shard_group->world_size() * options_.replicate_group->world_size() !=
          comm_->world_size()) {
        throw InvalidArgument(ctx("FullyShardedDataParallel()"),
                              "shard group size x replicate group size must equal world size");
      }
      if (options_.shard_group->world_size() > 1) shard_comm_ = options_.shard_group;
      if (options_.replicate_group->world_size() > 1) replicate_comm_ = options_.replicate_group;
      break;
  }
  if (shard_comm_) {
    shard_size_ = shard_comm_->world_size();
    shard_rank_ = shard_comm_->rank();
  }
  if (options_.mixed_precision.param_dtype) param_dtype_ = *options_.mixed_precision.param_dtype;
  reduce_dtype_ = options_.mixed_precision.reduce_dtype.value_or(param_dtype_);

  std::vector<std::pair<std::string, at::Tensor>> named;
  std::vector<at::Tensor> everything;
  for (const auto& item : module_->named_parameters(true)) {
    named.emplace_back(item.key(), item.value());
    everything.push_back(item.value());
  }
  for (const auto& item : module_->named_buffers(true)) {
    named.emplace_back("buffer " + item.key(), item.value());
    everything.push_back(item.value());
  }
  verify_same_model(*comm_, named, "FullyShardedDataParallel()");
  broadcast_from_rank0(*comm_, everything);
  build_units();
}

FullyShardedDataParallel::Impl::~Impl() {
  token_.reset();
  if (t_active == this) t_active = nullptr;
}

void FullyShardedDataParallel::Impl::build_units() {
  c10::NoGradGuard no_grad;
  units_.emplace_back();
  units_[0].name = "(root)";
  units_[0].module = module_.get();
  unit_of_module_[module_.get()] = 0;
  std::vector<std::string> prefixes = {""};
  if (options_.wrap_policy) {
    for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
      if (!options_.wrap_policy(item.key(), *item.value())) continue;
      Unit u;
      u.name = item.key();
      u.module = item.value().get();
      unit_of_module_[u.module] = static_cast<int>(units_.size());
      units_.push_back(std::move(u));
      prefixes.push_back(item.key() + ".");
    }
  }
  // Every trainable parameter belongs to its innermost unit (longest name prefix).
  for (const auto& item : module_->named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    size_t best = 0;
    for (size_t k = 1; k < prefixes.size(); ++k) {
      if (item.key().rfind(prefixes[k], 0) == 0 && prefixes[k].size() > prefixes[best].size())
        best = k;
    }
    units_[best].params.push_back(item.value());
    units_[best].param_names.push_back(item.key());
  }
  token_ = std::make_shared<Impl*>(this);
  std::weak_ptr<Impl*> weak = token_;
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = units_[k];
    for (const auto& p : u.params) {
      u.offsets.push_back(u.numel);
      u.numel += p.numel();
    }
    u.padded = padded_size(std::max<int64_t>(u.numel, 1), shard_size_);
    u.shard_numel = u.padded / shard_size_;
    const auto device = u.params.empty() ? c10::Device(c10::kCPU) : u.params.front().device();
    at::Tensor flat32 = at::zeros({u.padded}, at::TensorOptions().dtype(at::kFloat).device(device));
    for (size_t i = 0; i < u.params.size(); ++i) {
      flat32.narrow(0, u.offsets[i], u.params[i].numel()).copy_(u.params[i].reshape({-1}));
    }
    if (!sharded() && param_dtype_ == at::kFloat) {
      // Unsharded fp32: the master copy and the module's parameters can be the same memory
      // (the optimizer's update is then visible without a copy); keeping two would cost
      // more than DataParallel.
      u.full = flat32;
      u.shard = at::empty({0}, flat32.options());
      u.shard.set_(flat32.storage(), 0, {u.padded}, {1});
    } else {
      u.shard = flat32.narrow(0, shard_rank_ * u.shard_numel, u.shard_numel).clone();
      u.full = flat32.to(param_dtype_).clone();  // a storage of its own
    }
    u.shard.requires_grad_(true);
    for (size_t i = 0; i < u.params.size(); ++i) {
      at::Tensor& p = u.params[i];
      p.set_data(u.full.narrow(0, u.offsets[i], p.numel()).view(p.sizes()));
    }
    u.state = ParamState::kUnsharded;
    for (size_t i = 0; i < u.params.size(); ++i) {
      auto acc = compat::grad_accumulator(u.params[i]);
      const int index = static_cast<int>(k);
      compat::add_post_hook(acc, [weak, index] {
        if (auto self = weak.lock()) (*self)->on_grad_ready(index);
      });
      u.accumulators.push_back(std::move(acc));
    }
    shards_.push_back(u.shard);
    if (sharded()) reshard(u);
  }
}

int FullyShardedDataParallel::Impl::index_of(const torch::nn::Module& m) const {
  auto it = unit_of_module_.find(&m);
  return it == unit_of_module_.end() ? -1 : it->second;
}

// --- the unit's state machine ---

const char* FullyShardedDataParallel::Impl::state_name(ParamState s) {
  switch (s) {
    case ParamState::kSharded: return "SHARDED";
    case ParamState::kGathering: return "GATHERING";
    case ParamState::kUnsharded: return "UNSHARDED";
  }
  return "?";
}

const char* FullyShardedDataParallel::Impl::state_name(GradState s) {
  switch (s) {
    case GradState::kIdle: return "IDLE";
    case GradState::kAccumulating: return "ACCUMULATING";
    case GradState::kReducing: return "REDUCING";
    case GradState::kReduced: return "REDUCED";
  }
  return "?";
}

void FullyShardedDataParallel::Impl::expect(const Unit& u, const char* transition,
                                            ParamState from) {
  if (u.state == from) return;
  schedule_failed_ = true;
  throw Error(ctx(transition), fmt::format("internal error: unit '{}' is {}, {} needs {}", u.name,
                                           state_name(u.state), transition, state_name(from)));
}

void FullyShardedDataParallel::Impl::expect(const Unit& u, const char* transition,
                                            GradState from) {
  if (u.grad == from) return;
  schedule_failed_ = true;
  throw Error(ctx(transition), fmt::format("internal error: unit '{}' gradient is {}, {} needs {}",
                                           u.name, state_name(u.grad), transition,
                                           state_name(from)));
}

void FullyShardedDataParallel::Impl::unshard(Unit& u, const char* why) {
  expect(u, "unshard", ParamState::kSharded);
  c10::NoGradGuard no_grad;
  if (compat::storage_is_released(u.full)) {
    compat::refill_storage(u.full, static_cast<size_t>(u.padded) * u.full.element_size());
  }
  at::Tensor input = u.shard.detach().to(param_dtype_);
  if (!shard_comm_) {
    if (u.full.data_ptr() != input.data_ptr()) {
      std::memcpy(u.full.data_ptr(), input.data_ptr(), input.nbytes());
    }
    u.state = ParamState::kUnsharded;
  } else {
    u.gather_input = input;
    collective([&] { u.gather_work = shard_comm_->all_gather(u.full, input); });
    issued(Issued::kAllGather, u);
    u.state = ParamState::kGathering;
    stats_.bytes_communicated += static_cast<int64_t>(input.nbytes());
    stats_.num_collectives += 1;
  }
  record(fmt::format("all_gather:{}{}", u.name, why));
}

void FullyShardedDataParallel::Impl::wait_unsharded(Unit& u) {
  if (u.state == ParamState::kUnsharded) return;
  expect(u, "wait_unsharded", ParamState::kGathering);
  const auto start = Clock::now();
  collective([&] { u.gather_work->wait(); });
  stats_.comm_wait_s += std::chrono::duration<double>(Clock::now() - start).count();
  u.gather_work.reset();
  u.gather_input = at::Tensor();
  u.state = ParamState::kUnsharded;
}

void FullyShardedDataParallel::Impl::reshard(Unit& u) {
  expect(u, "reshard", ParamState::kUnsharded);
  // Unsharded configurations keep the memory; the next unshard refreshes it from the
  // (stepped) shard.
  if (sharded()) compat::release_storage(u.full);
  u.state = ParamState::kSharded;
}

void FullyShardedDataParallel::Impl::ensure_unsharded(Unit& u) {
  if (u.state == ParamState::kSharded) unshard(u, "");
  wait_unsharded(u);
}

void FullyShardedDataParallel::Impl::reshard_any(Unit& u) {
  if (u.state == ParamState::kGathering) wait_unsharded(u);  // never free memory a collective writes
  if (u.state == ParamState::kUnsharded) reshard(u);
}

void FullyShardedDataParallel::Impl::arm(Unit& u) {
  expect(u, "arm", GradState::kIdle);
  u.pending = static_cast<int>(u.params.size());
  u.grad = GradState::kAccumulating;
}

void FullyShardedDataParallel::Impl::launch_reduction(Unit& u) {
  expect(u, "launch_reduction", GradState::kAccumulating);
  c10::NoGradGuard no_grad;
  at::Tensor flat = at::zeros({u.padded}, u.full.options().dtype(reduce_dtype_));
  for (size_t i = 0; i < u.params.size(); ++i) {
    at::Tensor& p = u.params[i];
    if (p.grad().defined()) flat.narrow(0, u.offsets[i], p.numel()).copy_(p.grad().reshape({-1}));
    p.mutable_grad().reset();  // the unsharded gradient is not kept
  }
  // The unit's backward is over (all its gradients arrived): its parameters can go. A unit
  // that got no gradient may still be sharded or gathering (prefetched).
  reshard_any(u);
  if (shard_comm_) {
    u.reduce_out = at::empty({u.shard_numel}, flat.options());
    collective(
        [&] { u.reduce_work = shard_comm_->reduce_scatter(u.reduce_out, flat, ReduceOp::kAvg); });
    issued(Issued::kReduceScatter, u);
    stats_.bytes_communicated += static_cast<int64_t>(flat.nbytes());
    stats_.num_collectives += 1;
    record("reduce_scatter:" + u.name);
  } else {
    u.reduce_out = flat;
  }
  u.grad = GradState::kReducing;
}

void FullyShardedDataParallel::Impl::complete_reduction(Unit& u) {
  expect(u, "complete_reduction", GradState::kReducing);
  c10::NoGradGuard no_grad;
  if (u.reduce_work) collective([&] { u.reduce_work->wait(); });
  u.reduce_work.reset();
  if (replicate_comm_) {
    collective([&] { replicate_comm_->all_reduce(u.reduce_out, ReduceOp::kAvg)->wait(); });
    issued(Issued::kAllReduce, u);
    stats_.bytes_communicated += static_cast<int64_t>(u.reduce_out.nbytes());
    stats_.num_collectives += 1;
    record("all_reduce:" + u.name);
  }
  u.reduce_out = u.reduce_out.to(at::kFloat);
  u.grad = GradState::kReduced;
}

void FullyShardedDataParallel::Impl::accumulate(Unit& u) {
  expect(u, "accumulate", GradState::kReduced);
  c10::NoGradGuard no_grad;
  if (u.shard.grad().defined()) {
    u.shard.mutable_grad().add_(u.reduce_out);
  } else {
    u.shard.mutable_grad() = u.reduce_out.clone();
  }
  u.reduce_out = at::Tensor();
  u.grad = GradState::kIdle;
}

// Any state -> SHARDED / IDLE. Only after the step's collectives completed on this rank (the
// works are waited for here, never abandoned while they write).
void FullyShardedDataParallel::Impl::reset(Unit& u) {
  c10::NoGradGuard no_grad;
  for (WorkPtr* w : {&u.gather_work, &u.reduce_work}) {
    if (*w) {
      try {
        (*w)->wait();
      } catch (...) {
        // it failed: its buffers are no longer written; the failure was reported already
      }
      w->reset();
    }
  }
  u.gather_input = at::Tensor();
  u.reduce_out = at::Tensor();
  if (u.state != ParamState::kSharded) {
    u.state = ParamState::kUnsharded;
    reshard(u);
  }
  u.grad = GradState::kIdle;
  u.pending = 0;
  for (auto& p : u.params) p.mutable_grad().reset();
  if (u.shard.grad().defined()) u.shard.mutable_grad().zero_();
}

// --- the schedule ---

void FullyShardedDataParallel::Impl::prefetch(int index, const char* why) {
  if (index <= 0 || index >= static_cast<int>(units_.size()) || !sharded()) return;
  Unit& u = units_[index];
  if (u.state != ParamState::kSharded) return;
  int ahead = 0;
  for (size_t k = 1; k < units_.size(); ++k) ahead += units_[k].state == ParamState::kGathering;
  if (ahead >= options_.limit_all_gathers) return;
  unshard(u, why);
}

void FullyShardedDataParallel::Impl::begin_forward() {
  if (t_active != nullptr && t_active != this) {
    throw InvalidArgument(ctx("forward"), "another FSDP forward is running on this thread");
  }
  steps_.start_step("forward");  // first: a rank that called finish() meets this one here
  training_forward_ = c10::GradMode::is_enabled();
  {
    std::lock_guard<std::mutex> lock(mu_);
    log_.clear();
    stats_ = StepStats{};
  }
  forward_order_.clear();
  for (auto& u : units_) u.ran = false;
  try {
    ensure_unsharded(units_[0]);
    if (options_.forward_prefetch && !recorded_order_.empty())
      prefetch(recorded_order_[0], " (prefetch)");
  } catch (...) {
    std::rethrow_exception(steps_.break_with("forward", "gathering the root unit failed",
                                             std::current_exception()));
  }
  t_active = this;
}

at::Tensor FullyShardedDataParallel::Impl::unit_call(torch::nn::Module& module,
                                                     const std::function<at::Tensor()>& fn) {
  const int index = index_of(module);
  if (index <= 0) return fn();
  Unit& u = units_[index];
  const size_t position = forward_order_.size();
  if (!recorded_order_.empty() &&
      (position >= recorded_order_.size() || recorded_order_[position] != index)) {
    throw InvalidArgument(
        ctx("forward"),
        fmt::format("unit execution order changed: unit #{} of this forward is '{}', the first "
                    "iteration ran '{}' there; FSDP needs the same order every iteration",
                    position, u.name,
                    position < recorded_order_.size() ? units_[recorded_order_[position]].name
                                                      : "nothing"));
  }
  forward_order_.push_back(index);
  u.ran = true;
  ensure_unsharded(u);
  if (options_.forward_prefetch && position + 1 < recorded_order_.size()) {
    prefetch(recorded_order_[position + 1], " (prefetch)");
  }
  at::Tensor out;
  try {
    out = fn();
  } catch (...) {
    // Leave the unit as a peer's successful call would (forward_failed goes on from here).
    if (frees_after_forward() && u.state == ParamState::kUnsharded) reshard(u);
    throw;
  }
  if (frees_after_forward()) reshard(u);
  if (out.defined() && out.requires_grad()) {
    std::weak_ptr<Impl*> weak = token_;
    const int at = static_cast<int>(position);
    out.register_hook([weak, at](const at::Tensor&) {
      if (auto self = weak.lock()) (*self)->pre_backward(at);
    });
  }
  return out;
}

void FullyShardedDataParallel::Impl::end_forward(at::Tensor& /*output*/) {
  t_active = nullptr;
  if (recorded_order_.empty()) {
    for (size_t k = 1; k < units_.size(); ++k) {
      if (!units_[k].ran) {
        throw InvalidArgument(ctx("forward"),
                              fmt::format("unit '{}' was never run through dtrain::unit_call; "
                                          "wrap its forward call or change the wrap policy",
                                          units_[k].name));
      }
    }
    // Every rank must run units in the same order: compare a digest of it.
    // FNV-1a in unsigned arithmetic (wraps by definition; signed overflow would be UB).
    uint64_t digest = 14695981039346656037ULL;
    for (int i : forward_order_) digest = (digest ^ static_cast<uint32_t>(i)) * 1099511628211ULL;
    const int world = comm_->world_size();
    int64_t as_signed = 0;
    std::memcpy(&as_signed, &digest, sizeof(digest));
    at::Tensor mine = at::full({1}, as_signed, at::kLong);
    at::Tensor all = at::empty({world}, at::kLong);
    collective([&] { comm_->all_gather(all, mine)->wait(); });
    for (int r = 0; r < world; ++r) {
      if (all[r].item<int64_t>() != as_signed) {
        throw InvalidArgument(ctx("forward"),
                              fmt::format("units ran in a different order on rank {}", r));
      }
    }
    recorded_order_ = forward_order_;
    for (int i : recorded_order_) order_names_.push_back(units_[i].name);
  }
  // Gradients reduce in reverse execution order, the root (whose parameters, e.g. input
  // embeddings, finish last) at the end. A unit run several times (weight sharing) reduces
  // once: its gradients are complete after the backward of its first use, so it takes the
  // place of its first use.
  std::vector<char> seen(units_.size(), 0);
  reduce_order_.clear();
  for (int i : recorded_order_) {
    if (!seen[i]) reduce_order_.push_back(i);
    seen[i] = 1;
  }
  std::reverse(reduce_order_.begin(), reduce_order_.end());
  reduce_order_.push_back(0);
  if (!training_forward_) {
    // An evaluation forward has no backward: its outcome is agreed here.
    if (auto failure = steps_.agree(StepSync::Point::kForwardEnd, "forward", nullptr)) {
      reset_after_failure();  // as the failing rank does: unit states must match for the next step
      std::rethrow_exception(failure);
    }
  }
}

// `position`: the unit's place in the forward order, whose output's gradient just arrived.
void FullyShardedDataParallel::Impl::pre_backward(int position) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  Unit& u = units_[recorded_order_[position]];
  if (u.state == ParamState::kSharded) unshard(u, "");
  // Backward runs units in reverse forward order: the next one to need its parameters
  // is the unit before this one in the forward order.
  const int next = position > 0 ? recorded_order_[position - 1] : -1;
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre) prefetch(next, " (prefetch)");
  wait_unsharded(u);
}

void FullyShardedDataParallel::Impl::on_grad_ready(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  Unit& u = units_[index];
  expect(u, "gradient arrival", GradState::kAccumulating);
  if (--u.pending == 0) launch_ready_reductions();
}

void FullyShardedDataParallel::Impl::launch_ready_reductions() {
  // Strictly in the agreed order, so every rank issues the same collectives in the same order.
  while (next_reduce_ < reduce_order_.size() && units_[reduce_order_[next_reduce_]].pending <= 0) {
    if (next_reduce_ == 0) first_reduce_ = Clock::now();
    launch_reduction(units_[reduce_order_[next_reduce_]]);
    ++next_reduce_;
    if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost &&
        next_reduce_ < reduce_order_.size()) {
      prefetch(reduce_order_[next_reduce_], " (prefetch)");
    }
  }
}

void FullyShardedDataParallel::Impl::backward(const at::Tensor& loss) {
  steps_.check_usable("backward");
  if (reduce_order_.empty()) {
    throw InvalidArgument(ctx("backward"), "backward() before any forward() through the strategy");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    next_reduce_ = 0;
    for (auto& u : units_) arm(u);
    backward_log_.clear();
    in_backward_ = true;
    armed_ = true;
  }
  std::exception_ptr failure;
  try {
    loss.backward();
  } catch (...) {
    failure = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  try {
    if (schedule_failed_) {
      std::rethrow_exception(failure ? failure
                                     : std::make_exception_ptr(Error(ctx("backward"), "failed")));
    }
    if (failure) {
      // loss.backward() threw (the user's autograd code, or out of memory): issue what a
      // peer's backward still issues, then agree.
      if (comm_->world_size() > 1) {
        const bool prefix = backward_log_.size() <= last_backward_log_.size() &&
                            std::equal(backward_log_.begin(), backward_log_.end(),
                                       last_backward_log_.begin());
        if (!prefix || last_backward_log_.empty()) {
          std::rethrow_exception(steps_.break_with(
              "backward",
              last_backward_log_.empty()
                  ? "backward failed before any backward succeeded: the other ranks' remaining "
                    "collectives are unknown"
                  : "backward failed after collectives that differ from the last backward's",
              failure));
        }
        replay(last_backward_log_, backward_log_.size());
      }
    } else {
      // Units whose parameters got no gradient (or no parameters at all) reduce now, in order.
      for (auto& u : units_) u.pending = 0;
      launch_ready_reductions();
    }
  } catch (...) {
    in_backward_ = false;
    std::rethrow_exception(steps_.break_with(
        "backward", "its collectives may no longer match the other ranks'", std::current_exception()));
  }
  const auto wait_start = Clock::now();
  if (!failure) {
    try {
      for (int index : reduce_order_) complete_reduction(units_[index]);
    } catch (...) {
      in_backward_ = false;
      std::rethrow_exception(steps_.break_with(
          "backward",
          "a gradient collective failed (a rank that failed where it could not keep its "
          "collectives in step, exited or ran out of data stops issuing them)",
          std::current_exception()));
    }
  }
  in_backward_ = false;
  const auto done = Clock::now();
  if (auto outcome = steps_.agree(StepSync::Point::kBackwardEnd, "backward", failure)) {
    reset_after_failure();
    std::rethrow_exception(outcome);
  }
  last_backward_log_ = backward_log_;
  for (int index : reduce_order_) accumulate(units_[index]);
  stats_.comm_wait_s += std::chrono::duration<double>(done - wait_start).count();
  stats_.comm_total_s = std::chrono::duration<double>(done - first_reduce_).count();
  for (auto& u : units_) reshard_any(u);  // includes prefetched-but-unused units
}

// --- failures ---

template <typename Fn>
void FullyShardedDataParallel::Impl::collective(Fn&& fn) {
  try {
    fn();
  } catch (...) {
    schedule_failed_ = true;
    throw;
  }
}

void FullyShardedDataParallel::Impl::issued(Issued::Kind kind, const Unit& u) {
  if (in_backward_) backward_log_.push_back(Issued{kind, static_cast<int>(&u - units_.data())});
}

void FullyShardedDataParallel::Impl::replay(const std::vector<Issued>& ops, size_t from) {
  c10::NoGradGuard no_grad;
  for (size_t k = from; k < ops.size(); ++k) {
    const Unit& u = units_[ops[k].unit];
    const auto param = u.full.options().dtype(param_dtype_);
    const auto reduce = u.full.options().dtype(reduce_dtype_);
    switch (ops[k].kind) {
      case Issued::kAllGather:
        shard_comm_->all_gather(at::empty({u.padded}, param), at::zeros({u.shard_numel}, param))
            ->wait();
        record("all_gather:" + u.name + " (replay)");
        break;
      case Issued::kReduceScatter:
        shard_comm_
            ->reduce_scatter(at::empty({u.shard_numel}, reduce), at::zeros({u.padded}, reduce),
                             ReduceOp::kAvg)
            ->wait();
        record("reduce_scatter:" + u.name + " (replay)");
        break;
      case Issued::kAllReduce:
        replicate_comm_->all_reduce(at::zeros({u.shard_numel}, reduce), ReduceOp::kAvg)->wait();
        record("all_reduce:" + u.name + " (replay)");
        break;
    }
  }
}

void FullyShardedDataParallel::Impl::finish_forward_as_peers_do() {
  // unit_call without fn: the decisions (gather, prefetch, free) depend only on the unit
  // order and the units' states, which match the peers' at this point.
  for (size_t position = forward_order_.size(); position < recorded_order_.size(); ++position) {
    Unit& u = units_[recorded_order_[position]];
    ensure_unsharded(u);
    if (options_.forward_prefetch && position + 1 < recorded_order_.size()) {
      prefetch(recorded_order_[position + 1], " (prefetch)");
    }
    if (frees_after_forward()) reshard(u);
  }
}

void FullyShardedDataParallel::Impl::forward_failed(std::exception_ptr error) {
  t_active = nullptr;
  if (steps_.broken()) return;
  try {
    if (comm_->world_size() > 1) {
      if (schedule_failed_) {
        std::rethrow_exception(steps_.break_with(
            "forward", "its collectives may no longer match the other ranks'", error));
      }
      if (recorded_order_.empty() || (training_forward_ && last_backward_log_.empty())) {
        std::rethrow_exception(steps_.break_with(
            "forward",
            "the first step failed before FSDP recorded its schedule: the other ranks' "
            "remaining collectives are unknown",
            error));
      }
      finish_forward_as_peers_do();
      if (training_forward_) replay(last_backward_log_, 0);
    }
    steps_.agree(training_forward_ ? StepSync::Point::kBackwardEnd : StepSync::Point::kForwardEnd,
                 "forward", error);
  } catch (...) {
    steps_.break_with("forward", "its collectives may no longer match the other ranks'",
                      std::current_exception());
    return;  // broken: the next call throws; forward() rethrows `error` now
  }
  reset_after_failure();
}

void FullyShardedDataParallel::Impl::reset_after_failure() {
  armed_ = false;
  in_backward_ = false;
  next_reduce_ = 0;
  backward_log_.clear();
  for (auto& u : units_) reset(u);
}

void FullyShardedDataParallel::Impl::finish() {
  if (t_active == this) t_active = nullptr;
  steps_.finish();
}

double FullyShardedDataParallel::Impl::grad_norm() {
  steps_.check_usable("grad_norm");
  double sq = 0;
  for (const auto& u : units_) {
    sq += squared_norm(u.shard.grad());
  }
  if (shard_comm_) {
    // Shards are disjoint and padding holds zeros: the global sum is the sum of the parts.
    at::Tensor t = at::full({1}, sq, at::kDouble);
    shard_comm_->all_reduce(t, ReduceOp::kSum)->wait();
    sq = t.item<double>();
  }
  return std::sqrt(sq);
}

int64_t FullyShardedDataParallel::Impl::model_state_bytes(
    const std::vector<at::Tensor>& optimizer_state) {
  std::vector<at::Tensor> all = optimizer_state;
  for (const auto& u : units_) {
    all.push_back(u.shard);
    all.push_back(u.shard.grad());
    all.push_back(u.full);
    for (const auto& p : u.params) all.push_back(p.grad());
  }
  return tensor_bytes(all);
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::Impl::full_state_dict() {
  steps_.check_usable("full_state_dict");
  c10::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& u : units_) {
    // Gather the fp32 master shards (not the compute-dtype copy) so nothing is rounded.
    at::Tensor flat = at::empty({u.padded}, u.shard.options().requires_grad(false));
    if (shard_comm_) {
      shard_comm_->all_gather(flat, u.shard.detach())->wait();
    } else {
      flat.copy_(u.shard.detach());
    }
    if (comm_->rank() != 0) continue;
    for (size_t i = 0; i < u.params.size(); ++i) {
      out.emplace_back(
          u.param_names[i],
          flat.narrow(0, u.offsets[i], u.params[i].numel()).view(u.params[i].sizes()).clone());
    }
  }
  if (comm_->rank() == 0) {
    for (const auto& item : module_->named_buffers(true))
      out.emplace_back(item.key(), item.value().clone());
    // Module order, as torch::nn::Module::named_parameters lists them.
    std::map<std::string, size_t> position;
    size_t k = 0;
    for (const auto& item : module_->named_parameters(true)) position[item.key()] = k++;
    for (const auto& item : module_->named_buffers(true)) position[item.key()] = k++;
    std::stable_sort(out.begin(), out.end(), [&](const auto& a, const auto& b) {
      return position[a.first] < position[b.first];
    });
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>>
FullyShardedDataParallel::Impl::sharded_state_dict() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& u : units_) {
    out.emplace_back(u.name + ".flat_shard", u.shard.detach().clone());
    // [shard rank, shard group size, unpadded numel, padded numel]: enough to reassemble
    // the flat buffer and re-shard it for another world size.
    out.emplace_back(
        u.name + ".flat_meta",
        at::tensor({int64_t{shard_rank_}, int64_t{shard_size_}, u.numel, u.padded}, at::kLong));
    for (size_t i = 0; i < u.params.size(); ++i) {
      out.emplace_back(u.name + ".param." + u.param_names[i],
                       at::tensor({u.offsets[i], u.params[i].numel()}, at::kLong));
    }
  }
  return out;
}

// --- checkpoint support (dtrain/checkpoint.h) ---

StateLayout FullyShardedDataParallel::Impl::state_layout() {
  static constexpr const char* kNames[] = {"full_shard", "shard_grad_op", "no_shard",
                                           "hybrid_shard"};
  StateLayout layout;
  const int replica = replicate_comm_ ? replicate_comm_->rank() : 0;
  const int replicas = replicate_comm_ ? replicate_comm_->world_size() : 1;
  layout.sharding = fmt::format("fsdp {} (shard group {}, {} replica group(s))",
                                kNames[static_cast<int>(options_.sharding)], shard_size_, replicas);
  layout.comm = comm_;
  // A parameter's slice is where its flat range [offset, offset + numel) in the unit meets
  // this rank's shard [shard_begin, shard_begin + shard_numel).
  std::map<std::string, StateSlice> sharded;
  for (auto& u : units_) {
    const int64_t shard_begin = shard_rank_ * u.shard_numel;
    const int64_t shard_end = shard_begin + u.shard_numel;
    for (size_t i = 0; i < u.params.size(); ++i) {
      StateSlice s;
      s.name = u.param_names[i];
      s.shape = u.params[i].sizes().vec();
      s.dtype = at::kFloat;  // the master shards' dtype, whatever the compute dtype
      const int64_t off = u.offsets[i], n = u.params[i].numel();
      const int64_t lo = std::max(off, shard_begin), hi = std::min(off + n, shard_end);
      if (hi > lo) {
        s.begin = lo - off;
        s.end = hi - off;
        s.stepped_offset = lo - shard_begin;
      }
      s.data = u.shard.detach().narrow(0, s.stepped_offset, s.end - s.begin);
      s.stepped = u.shard;
      s.replica = replica;
      s.num_replicas = replicas;
      sharded.emplace(s.name, std::move(s));
    }
  }
  // Module order; frozen parameters and buffers are not in any unit and held in full.
  StateLayout rest = replicated_state_layout(*module_, comm_, "");
  for (auto& s : rest.slices) {
    auto it = sharded.find(s.name);
    layout.slices.push_back(it != sharded.end() && s.kind == StateSlice::Kind::kParameter
                                ? std::move(it->second)
                                : std::move(s));
  }
  return layout;
}

void FullyShardedDataParallel::Impl::state_loaded() {
  // The shards changed: no gathered copy may be reused; each is rebuilt at its next use.
  for (auto& u : units_) reshard_any(u);
}

// --- public wrapper ---

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   CommunicatorPtr comm, FsdpOptions options)
    : impl_(std::make_unique<Impl>(std::move(module), std::move(comm), std::move(options))) {}
FullyShardedDataParallel::~FullyShardedDataParallel() = default;

void FullyShardedDataParallel::begin_forward() { impl_->begin_forward(); }
void FullyShardedDataParallel::end_forward(at::Tensor& output) { impl_->end_forward(output); }
void FullyShardedDataParallel::forward_failed(std::exception_ptr error) noexcept {
  impl_->forward_failed(std::move(error));
}
void FullyShardedDataParallel::finish() { impl_->finish(); }
void FullyShardedDataParallel::backward(const at::Tensor& loss) { impl_->backward(loss); }
std::vector<at::Tensor> FullyShardedDataParallel::parameters() { return impl_->shards_; }
double FullyShardedDataParallel::grad_norm() { return impl_->grad_norm(); }
int64_t FullyShardedDataParallel::model_state_bytes(
    const std::vector<at::Tensor>& optimizer_state) {
  return impl_->model_state_bytes(optimizer_state);
}
const StepStats& FullyShardedDataParallel::last_step_stats() const { return impl_->stats_; }
int FullyShardedDataParallel::rank() const { return impl_->comm_->rank(); }
int FullyShardedDataParallel::world_size() const { return impl_->comm_->world_size(); }
std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::full_state_dict() {
  return impl_->full_state_dict();
}
std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::sharded_state_dict() {
  return impl_->sharded_state_dict();
}
StateLayout FullyShardedDataParallel::state_layout() { return impl_->state_layout(); }
void FullyShardedDataParallel::state_loaded() { impl_->state_loaded(); }
std::vector<std::string> FullyShardedDataParallel::last_collective_log() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->log_;
}
std::vector<std::string> FullyShardedDataParallel::unit_order() const {
  return impl_->order_names_;
}

at::Tensor unit_call(torch::nn::Module& module, const std::function<at::Tensor()>& fn) {
  if (t_active == nullptr) return fn();
  return t_active->unit_call(module, fn);
}

}  // namespace dtrain

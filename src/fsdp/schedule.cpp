#include "fsdp/schedule.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/control_plane.h"
#include "compress/quantized_all_gather.h"
#include "dtrain/errors.h"
#include "strategy/step_driver.h"

namespace dtrain::fsdp {

const char* Schedule::name_of(Phase phase) {
  switch (phase) {
    case Phase::kUnrecorded:
      return "UNRECORDED";
    case Phase::kRecorded:
      return "RECORDED";
    case Phase::kArmed:
      return "ARMED";
    case Phase::kDraining:
      return "DRAINING";
  }
  return "?";
}

void Schedule::expect(const char* transition, std::initializer_list<Phase> from) {
  for (Phase p : from) {
    if (phase_ == p) return;
  }
  failed();
  std::vector<const char*> names;
  for (Phase p : from) names.push_back(name_of(p));
  throw Error(ErrorContext{comms_.rank, comms_.world_size, transition, -1},
              fmt::format("internal error: FSDP schedule is {}, {} needs {}", name_of(phase_),
                          transition, fmt::join(names, " or ")));
}

Schedule::Schedule(ScheduleOptions options, UnitComms comms, StepFailure& failure)
    : options_(options), comms_(std::move(comms)), failure_(failure) {}

Schedule::~Schedule() = default;

void Schedule::add_unit(std::string name, const torch::nn::Module* module, FlatParam flat) {
  const int index = static_cast<int>(units_.size());
  unit_of_module_[module] = index;
  UnitObserver* observer = this;  // the private base, reachable here
  units_.emplace_back(index, std::move(name), std::move(flat), &comms_, observer);
  ran_.push_back(0);
  running_.push_back(0);
  Unit& u = units_.back();
  for (size_t i = 0; i < u.flat().num_params(); ++i) {
    hooks_.add(u.flat().param(i), [this, index] { on_grad_ready(index); });
  }
  if (sharded()) u.reshard();
}

int Schedule::unit_of(const torch::nn::Module& m) const {
  auto it = unit_of_module_.find(&m);
  return it == unit_of_module_.end() ? -1 : it->second;
}

std::vector<std::string> Schedule::log() const {
  std::lock_guard<std::mutex> lock(mu_);
  return log_;
}

void Schedule::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  log_.clear();
  stats_ = StepStats{};
}

StepStats Schedule::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Schedule::issued(Collective kind, int unit, int64_t bytes) {
  if (phase_ == Phase::kArmed || phase_ == Phase::kDraining) {
    backward_log_.push_back(Issued{kind, unit});
  }
  stats_.bytes_communicated += bytes;
  stats_.num_collectives += 1;
}

void Schedule::waited(Clock::duration d) {
  stats_.comm_wait_s += std::chrono::duration<double>(d).count();
}

void Schedule::prefetch(int index, const char* why) {
  if (index <= 0 || index >= static_cast<int>(units_.size()) || !sharded()) return;
  Unit& u = units_[index];
  if (u.param_state() != Unit::ParamState::kSharded &&
      u.param_state() != Unit::ParamState::kShardedPostForward) {
    return;
  }
  int ahead = 0;
  for (size_t k = 1; k < units_.size(); ++k) {
    ahead += units_[k].param_state() == Unit::ParamState::kGathering;
  }
  if (ahead >= options_.limit_all_gathers) return;
  u.unshard(why);
}

// --- forward ---

void Schedule::begin_forward() {
  expect("begin_forward", {Phase::kUnrecorded, Phase::kRecorded});
  forward_order_.clear();
  forward_reads_.clear();
  std::fill(ran_.begin(), ran_.end(), 0);
  std::fill(running_.begin(), running_.end(), 0);
  units_[0].ensure_unsharded();
  if (options_.forward_prefetch && !recorded_order_.empty()) {
    prefetch(recorded_order_[0], " (prefetch)");
  }
}

int Schedule::enter_unit(const torch::nn::Module& m, bool reads_in_backward) {
  const int index = unit_of(m);
  if (index <= 0 || running_[index]) return -1;
  Unit& u = units_[index];
  const size_t position = forward_order_.size();
  const ErrorContext ctx{comms_.rank, comms_.world_size, "forward", -1};
  if (order_recorded() &&
      (position >= recorded_order_.size() || recorded_order_[position] != index)) {
    throw InvalidArgument(
        ctx,
        fmt::format("unit execution order changed: unit #{} of this forward is '{}', the first "
                    "iteration ran '{}' there; FSDP needs the same order every iteration",
                    position, u.name(),
                    position < recorded_order_.size() ? units_[recorded_order_[position]].name()
                                                      : "nothing"));
  }
  if (order_recorded() && recorded_reads_[position] != static_cast<char>(reads_in_backward)) {
    throw InvalidArgument(ctx,
                          fmt::format("unit #{} of this forward, '{}', is called with "
                                      "ParamsInBackward::{}, the first iteration used {}",
                                      position, u.name(), reads_in_backward ? "kRead" : "kNotRead",
                                      reads_in_backward ? "kNotRead" : "kRead"));
  }
  if (!reads_in_backward) {
    for (size_t k = 0; k < position; ++k) {
      if (forward_order_[k] == index && forward_reads_[k]) {
        throw InvalidArgument(
            ctx, fmt::format("unit '{}' is called with ParamsInBackward::kNotRead after a call "
                             "with kRead in the same forward: freeing it would invalidate that "
                             "call's saved parameters; use kRead for both calls",
                             u.name()));
      }
    }
  }
  forward_order_.push_back(index);
  forward_reads_.push_back(static_cast<char>(reads_in_backward));
  ran_[index] = 1;
  running_[index] = 1;
  u.ensure_unsharded();
  if (options_.forward_prefetch && position + 1 < recorded_order_.size()) {
    prefetch(recorded_order_[position + 1], " (prefetch)");
  }
  return static_cast<int>(position);
}

void Schedule::exit_unit(int position, bool threw) {
  Unit& u = units_[forward_order_[position]];
  running_[forward_order_[position]] = 0;
  if (!frees_after_forward() || kept_for_later_call(position)) return;
  if (threw && u.param_state() != Unit::ParamState::kUnsharded) return;
  free_after_call(u, forward_reads_[position] != 0);
  // Nothing gathers the unit for this call's backward: a parameter autograd saved would be
  // read from freed memory. A version bump turns that into autograd's "modified by an inplace
  // operation" error (FSDP's backward names the cause).
  if (!forward_reads_[position] && sharded() && !threw) u.flat().bump_param_versions();
}

void Schedule::free_after_call(Unit& u, bool reads_in_backward) {
  // Grad mode off: no backward follows, nothing will gather from the host pieces. The same
  // on every rank, as are the other inputs, so all ranks free alike.
  if (options_.after_forward == ReshardAfterForward::kHost && sharded() && reads_in_backward &&
      c10::GradMode::is_enabled()) {
    u.reshard_to_host();
  } else {
    u.reshard();
  }
}

void Schedule::hook_outputs(int position, const std::vector<at::Tensor>& outputs) {
  // Shared by this use's hooks: only the first gradient to arrive gathers (a later one may
  // come after the unit's backward ended and it was freed again).
  auto fired = std::make_shared<bool>(false);
  auto gather = hooks_.guard([this, position] { pre_backward(position); });
  for (const at::Tensor& output : outputs) {
    if (!output.defined() || !output.requires_grad()) continue;
    output.register_hook([gather, fired](const at::Tensor&) {
      if (*fired) return;
      *fired = true;
      gather();
    });
  }
}

void Schedule::end_forward(Communicator& world) {
  expect("end_forward", {Phase::kUnrecorded, Phase::kRecorded});
  const ErrorContext ctx{comms_.rank, comms_.world_size, "forward", -1};
  if (!order_recorded()) {
    for (size_t k = 1; k < units_.size(); ++k) {
      if (!ran_[k]) {
        throw InvalidArgument(ctx, fmt::format("unit '{}' was never run through dtrain::unit_call; "
                                               "wrap its forward call (or hold the module in a "
                                               "torch::nn::Sequential) or change the wrap policy",
                                               units_[k].name()));
      }
    }
    // Every rank must run units in the same order (and the same ParamsInBackward, which
    // decides prefetches): compare a digest of it.
    // FNV-1a in unsigned arithmetic (wraps by definition; signed overflow would be UB).
    uint64_t digest = 14695981039346656037ULL;
    for (size_t k = 0; k < forward_order_.size(); ++k) {
      const uint32_t entry =
          static_cast<uint32_t>(forward_order_[k]) * 2 + (forward_reads_[k] ? 1 : 0);
      digest = (digest ^ entry) * 1099511628211ULL;
    }
    const int n = world.world_size();
    int64_t as_signed = 0;
    std::memcpy(&as_signed, &digest, sizeof(digest));
    std::vector<int64_t> all;
    try {
      all = ControlPlane(world).all_gather(std::vector<int64_t>{as_signed});
    } catch (...) {
      failed();
      throw;
    }
    for (int r = 0; r < n; ++r) {
      if (all[static_cast<size_t>(r)] != as_signed) {
        throw InvalidArgument(ctx, fmt::format("units ran in a different order on rank {}", r));
      }
    }
    recorded_order_ = forward_order_;
    recorded_reads_ = forward_reads_;
    gathered_in_backward_.assign(units_.size(), 0);
    later_call_.assign(recorded_order_.size(), 0);
    std::vector<char> seen_later(units_.size(), 0);
    for (size_t k = recorded_order_.size(); k-- > 0;) {
      const int i = recorded_order_[k];
      if (recorded_reads_[k]) gathered_in_backward_[i] = 1;
      later_call_[k] = seen_later[i];
      seen_later[i] = 1;
    }
    for (int i : recorded_order_) order_names_.push_back(units_[i].name());
    phase_ = Phase::kRecorded;
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
}

// --- backward ---

void Schedule::arm() {
  expect("arm", {Phase::kRecorded});
  next_reduce_ = 0;
  next_replicate_ = 0;
  for (auto& u : units_) u.arm();
  backward_log_.clear();
  phase_ = Phase::kArmed;
}

void Schedule::disarm() {
  expect("disarm", {Phase::kArmed});
  phase_ = Phase::kDraining;
}

void Schedule::end_backward() {
  expect("end_backward", {Phase::kDraining});
  phase_ = Phase::kRecorded;
}

// `position`: the unit's place in the forward order, whose output's gradient just arrived.
void Schedule::pre_backward(int position) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ != Phase::kArmed) return;  // a hook firing outside the strategy's backward
  Unit& u = units_[recorded_order_[position]];
  if (u.param_state() == Unit::ParamState::kSharded ||
      u.param_state() == Unit::ParamState::kShardedPostForward) {
    u.unshard("");
  }
  // Backward runs units in reverse forward order: the next one to need its parameters
  // is the unit before this one in the forward order, unless that call's backward reads none.
  const int next =
      position > 0 && recorded_reads_[position - 1] ? recorded_order_[position - 1] : -1;
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre) prefetch(next, " (prefetch)");
  if (u.param_state() == Unit::ParamState::kGathering) u.wait_unsharded();
}

void Schedule::on_grad_ready(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ != Phase::kArmed) return;  // a hook firing outside the strategy's backward
  if (units_[index].gradient_arrived()) launch_ready_reductions();
}

void Schedule::launch_ready_reductions() {
  // Strictly in the agreed order, so every rank issues the same collectives in the same order.
  while (next_reduce_ < reduce_order_.size() &&
         units_[reduce_order_[next_reduce_]].pending() <= 0) {
    if (next_reduce_ == 0) first_reduce_ = Clock::now();
    Unit& u = units_[reduce_order_[next_reduce_]];
    if (sync_) {
      u.launch_reduction();
    } else {
      u.hold();
    }
    ++next_reduce_;
    // Over replicas, as DDP does: this unit's all-reduce right away when there is nothing
    // to wait for; otherwise the previous unit's, whose reduce-scatter ran while this
    // unit's backward did. Positions only, so every rank issues the same order.
    if (sync_ && comms_.replicate) replicate_until(sharded() ? next_reduce_ - 1 : next_reduce_);
    if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost &&
        next_reduce_ < reduce_order_.size() && gathered_in_backward_[reduce_order_[next_reduce_]]) {
      prefetch(reduce_order_[next_reduce_], " (prefetch)");
    }
  }
}

void Schedule::flush() {
  for (auto& u : units_) u.stop_waiting();
  launch_ready_reductions();
}

void Schedule::replicate_until(size_t end) {
  for (; next_replicate_ < end; ++next_replicate_)
    units_[reduce_order_[next_replicate_]].replicate();
}

void Schedule::complete() {
  if (!sync_) return;
  if (comms_.replicate) replicate_until(next_reduce_);
  for (int index : reduce_order_) units_[index].complete_reduction();
}

void Schedule::accumulate() {
  if (!sync_) return;
  for (int index : reduce_order_) units_[index].accumulate();
}

void Schedule::reshard_all() {
  for (auto& u : units_) u.reshard_any();
}

// --- failures ---

void Schedule::replay(const std::vector<Issued>& ops, size_t from) {
  c10::NoGradGuard no_grad;
  for (size_t k = from; k < ops.size(); ++k) {
    const FlatParam& f = units_[ops[k].unit].flat();
    const std::string& name = units_[ops[k].unit].name();
    const auto param = f.full().options().dtype(f.param_dtype());
    const auto reduce = f.full().options().dtype(comms_.reduce_dtype);
    switch (ops[k].kind) {
      case Collective::kAllGather:
        // As the peers issue it: quantised on the wire when they quantise.
        if (comms_.quantize_params != Quantization::kNone) {
          detail::quantized_all_gather(*comms_.shard, at::empty({f.padded()}, param),
                                       at::zeros({f.shard_numel()}, param), comms_.quantize_params,
                                       comms_.quantization_block, nullptr)
              ->wait();
        } else {
          comms_.shard
              ->all_gather(at::empty({f.padded()}, param), at::zeros({f.shard_numel()}, param))
              ->wait();
        }
        record("all_gather:" + name + " (replay)");
        break;
      case Collective::kReduceScatter: {
        int64_t bytes = 0;
        reduce_scatter_grads(comms_, at::empty({f.shard_numel()}, reduce),
                             at::zeros({f.padded()}, reduce), &bytes)
            ->wait();
      }
        record("reduce_scatter:" + name + " (replay)");
        break;
      case Collective::kAllReduce:
        comms_.replicate->all_reduce(at::zeros({f.shard_numel()}, reduce), ReduceOp::kAvg)->wait();
        record("all_reduce:" + name + " (replay)");
        break;
      case Collective::kHostAllGather:
        comms_.host
            ->all_gather(at::empty({f.padded()}, param),
                         at::zeros({f.padded() / comms_.host_size}, param))
            ->wait();
        record("all_gather_host:" + name + " (replay)");
        break;
    }
  }
}

void Schedule::finish_forward_as_peers_do() {
  // The unit calls without their forward: the decisions (gather, prefetch, free) depend only
  // on the unit order and the units' states, which match the peers' at this point.
  for (size_t position = forward_order_.size(); position < recorded_order_.size(); ++position) {
    Unit& u = units_[recorded_order_[position]];
    u.ensure_unsharded();
    if (options_.forward_prefetch && position + 1 < recorded_order_.size()) {
      prefetch(recorded_order_[position + 1], " (prefetch)");
    }
    if (frees_after_forward() && !kept_for_later_call(position)) {
      free_after_call(u, recorded_reads_[position] != 0);
    }
  }
}

std::exception_ptr Schedule::backward(const std::function<void()>& autograd, int world_size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    arm();
  }
  std::exception_ptr failure;
  try {
    autograd();
  } catch (...) {
    failure = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu_);
  disarm();
  try {
    if (out_of_step()) {
      std::rethrow_exception(
          failure ? failure
                  : std::make_exception_ptr(Error(
                        ErrorContext{comms_.rank, comms_.world_size, "backward", -1}, "failed")));
    }
    if (failure) {
      // autograd threw (the user's autograd code, or out of memory): issue what a peer's
      // backward still issues, then the driver agrees.
      if (world_size > 1) {
        const auto& now = backward_log_;
        const auto& last = last_backward_log();
        const bool prefix =
            now.size() <= last.size() && std::equal(now.begin(), now.end(), last.begin());
        if (!prefix || last.empty()) {
          throw StepBreak{last.empty()
                              ? "backward failed before any backward succeeded: the other ranks' "
                                "remaining collectives are unknown"
                              : "backward failed after collectives that differ from the last "
                                "backward's",
                          failure};
        }
        replay(last, now.size());
      }
    } else {
      flush();
    }
  } catch (const StepBreak&) {
    end_backward();
    throw;
  } catch (...) {
    end_backward();
    break_step("its collectives may no longer match the other ranks'");
  }
  const auto wait_start = Clock::now();
  const double waited_before = stats_.comm_wait_s;  // complete()'s waits are in the window
  if (!failure) {
    try {
      complete();
    } catch (...) {
      end_backward();
      break_step(
          "a gradient collective failed (a rank that failed where it could not keep its "
          "collectives in step, exited or ran out of data stops issuing them)");
    }
  }
  end_backward();
  const auto done = Clock::now();
  stats_.comm_wait_s = waited_before + std::chrono::duration<double>(done - wait_start).count();
  stats_.comm_total_s = std::chrono::duration<double>(done - first_reduce_).count();
  return failure;
}

void Schedule::commit_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  last_backward_log_[sync_] = backward_log_;
  accumulate();
  reshard_all();  // includes prefetched-but-unused units
}

void Schedule::issue_as_peers_do(bool training, int world_size) {
  if (world_size <= 1) return;
  if (!order_recorded() || (training && last_backward_log().empty())) {
    throw StepBreak{
        "the first step failed before FSDP recorded its schedule: the other ranks' remaining "
        "collectives are unknown",
        nullptr};
  }
  finish_forward_as_peers_do();
  if (training) replay(last_backward_log(), 0);
}

void Schedule::reset() {
  if (phase_ != Phase::kUnrecorded) phase_ = Phase::kRecorded;
  next_reduce_ = 0;
  next_replicate_ = 0;
  backward_log_.clear();
  for (auto& u : units_) u.reset();
}

}  // namespace dtrain::fsdp

// The memory planner's arithmetic (docs/strategies.md, "Memory per rank"): pure functions of
// counts, so that a run is judged before anything is allocated.
#include "dtrain/memory_plan.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/errors.h"

namespace dtrain {
namespace {

constexpr int64_t kFp32 = 4;

const char* sharding_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard:
      return "full";
    case ShardingStrategy::kShardGradOp:
      return "grad_op";
    case ShardingStrategy::kNoShard:
      return "no_shard";
    case ShardingStrategy::kHybridShard:
      return "hybrid";
  }
  return "?";
}

double gib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(1 << 30); }

void check_inputs(const ModelMemory& model, const TrainingMemory& training) {
  if (training.world_size < 1) {
    throw InvalidArgument(
        fmt::format("memory plan: world size must be positive, got {}", training.world_size));
  }
  const bool negative_unit =
      std::any_of(model.units.begin(), model.units.end(), [](int64_t u) { return u < 0; });
  if (model.parameters < 0 || model.activation_bytes < 0 || negative_unit ||
      training.compute_bytes < 1 || training.optimizer_states < 0 || training.bucket_bytes < 0 ||
      training.gathered_units < 1 || training.runtime_bytes < 0) {
    throw InvalidArgument(
        "memory plan: counts and bytes must not be negative (compute bytes and gathered units "
        "at least 1)");
  }
}

}  // namespace

int PlannedStrategy::shard_size(int world_size) const {
  if (kind != Kind::kFsdp) return 1;
  switch (sharding) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      return world_size;
    case ShardingStrategy::kNoShard:
      return 1;
    case ShardingStrategy::kHybridShard:
      return shard_group_size;
  }
  return 1;
}

std::string PlannedStrategy::flags() const {
  switch (kind) {
    case Kind::kSingle:
      return "--strategy single";
    case Kind::kDataParallel:
      return "--strategy ddp";
    case Kind::kFsdp:
      break;
  }
  std::string out = fmt::format("--strategy fsdp --sharding {}", sharding_name(sharding));
  if (sharding == ShardingStrategy::kHybridShard) {
    out += fmt::format(" --shard_group_size {}", shard_group_size);
  }
  return out;
}

bool PlannedStrategy::operator==(const PlannedStrategy& o) const {
  if (kind != o.kind) return false;
  if (kind != Kind::kFsdp) return true;
  return sharding == o.sharding &&
         (sharding != ShardingStrategy::kHybridShard || shard_group_size == o.shard_group_size);
}

int64_t MemoryEstimate::total() const {
  return parameter_bytes + gathered_bytes + gradient_bytes + optimizer_bytes + buffer_bytes +
         activation_bytes + runtime_bytes;
}

std::string MemoryEstimate::to_string() const {
  std::string parts = fmt::format("parameters {:.2f}", gib(parameter_bytes));
  if (gathered_bytes > 0) parts += fmt::format(", gathered {:.2f}", gib(gathered_bytes));
  parts += fmt::format(", gradients {:.2f}, optimizer {:.2f}", gib(gradient_bytes),
                       gib(optimizer_bytes));
  if (buffer_bytes > 0) parts += fmt::format(", buffers {:.2f}", gib(buffer_bytes));
  parts += fmt::format(", activations {:.2f}, runtime {:.2f} GiB", gib(activation_bytes),
                       gib(runtime_bytes));
  if (host_bytes > 0) parts += fmt::format("; host memory {}", format_gib(host_bytes));
  return fmt::format("{} ({})", format_gib(total()), parts);
}

MemoryEstimate estimate_memory(const ModelMemory& model, const TrainingMemory& training,
                               const PlannedStrategy& strategy) {
  check_inputs(model, training);
  const int world = training.world_size;
  if (strategy.kind == PlannedStrategy::Kind::kSingle && world != 1) {
    throw InvalidArgument(
        fmt::format("memory plan: single runs one rank, the world size is {}", world));
  }
  if (strategy.kind == PlannedStrategy::Kind::kFsdp &&
      strategy.sharding == ShardingStrategy::kHybridShard &&
      (strategy.shard_group_size < 1 || world % strategy.shard_group_size != 0)) {
    throw InvalidArgument(
        fmt::format("memory plan: hybrid shard group size {} does not divide the world size {}",
                    strategy.shard_group_size, world));
  }
  const int64_t P = model.parameters, c = training.compute_bytes;
  const int64_t k = training.optimizer_states;
  MemoryEstimate e;
  e.strategy = strategy;
  e.activation_bytes = model.activation_bytes;
  e.runtime_bytes = training.runtime_bytes;

  if (strategy.kind != PlannedStrategy::Kind::kFsdp) {
    e.parameter_bytes = kFp32 * P;
    e.gradient_bytes = kFp32 * P;
    e.optimizer_bytes = kFp32 * k * P;
    // Autocast caches a compute-dtype copy of each weight for the forward.
    e.gathered_bytes = c < kFp32 ? c * P : 0;
    if (strategy.kind == PlannedStrategy::Kind::kDataParallel) {
      // Gradients live in the buckets; one bucket in flight needs the transport's scratch.
      e.buffer_bytes = std::min(training.bucket_bytes, kFp32 * P);
    }
    return e;
  }

  const int64_t S = strategy.shard_size(world);
  const int64_t shard = (P + S - 1) / S;
  std::vector<int64_t> units = model.units;
  std::sort(units.begin(), units.end(), std::greater<>());
  const int64_t in_units = std::accumulate(units.begin(), units.end(), int64_t{0});
  const int64_t root = std::max<int64_t>(0, P - in_units);
  const int64_t largest = std::max(root, units.empty() ? int64_t{0} : units.front());
  e.parameter_bytes = kFp32 * shard;
  e.optimizer_bytes = kFp32 * k * shard;
  // The shard's gradient, and one unit's unsharded gradient while it is reduced.
  e.gradient_bytes = kFp32 * shard + c * largest;
  if (S == 1) {
    // Nothing is freed: fp32 shares the shard's memory; another dtype keeps a full copy.
    e.gathered_bytes = c < kFp32 ? c * P : 0;
  } else if (strategy.sharding == ShardingStrategy::kShardGradOp) {
    e.gathered_bytes = c * P;  // kept gathered from forward to the end of backward
  } else {
    // The root all step, and the largest units that can be gathered at once.
    int64_t gathered = root;
    for (size_t i = 0; i < units.size() && i < static_cast<size_t>(training.gathered_units); ++i) {
      gathered += units[i];
    }
    e.gathered_bytes = c * std::min(gathered, P);
  }
  if (training.accumulates) e.buffer_bytes = kFp32 * P;  // unsharded fp32 gradients, held
  if (training.cpu_offload) {
    // The fp32 state moves to host memory. The device keeps the gathered units (now also
    // in fp32 and unsharded: the shard is no longer there to share their memory), one
    // unit's unsharded gradient, and the device copies of one unit's shard and its reduced
    // gradient shard on their way to and from the host.
    e.host_bytes = e.parameter_bytes + kFp32 * shard + e.optimizer_bytes;
    const int64_t unit_shard = (largest + S - 1) / S;
    e.parameter_bytes = 0;
    e.optimizer_bytes = 0;
    e.gradient_bytes = c * largest + kFp32 * unit_shard;
    if (S == 1) e.gathered_bytes = c * P;
    e.gathered_bytes += kFp32 * unit_shard;
  }
  return e;
}

std::vector<PlannedStrategy> candidate_strategies(int world_size) {
  using Kind = PlannedStrategy::Kind;
  if (world_size <= 1) return {PlannedStrategy{Kind::kSingle, ShardingStrategy::kFullShard, 0}};
  std::vector<PlannedStrategy> out = {
      PlannedStrategy{Kind::kDataParallel, ShardingStrategy::kFullShard, 0},
      PlannedStrategy{Kind::kFsdp, ShardingStrategy::kShardGradOp, 0}};
  for (int g = 2; g < world_size; ++g) {
    if (world_size % g == 0) {
      out.push_back(PlannedStrategy{Kind::kFsdp, ShardingStrategy::kHybridShard, g});
    }
  }
  out.push_back(PlannedStrategy{Kind::kFsdp, ShardingStrategy::kFullShard, 0});
  return out;
}

std::optional<MemoryEstimate> MemoryPlan::choice() const {
  for (const auto& e : estimates) {
    if (fits(e)) return e;
  }
  return std::nullopt;
}

std::string MemoryPlan::summary() const {
  std::string out;
  for (const auto& e : estimates) {
    out += fmt::format("  {}: {} {}\n", e.strategy.flags(), e.to_string(),
                       fits(e) ? "fits" : "does not fit");
  }
  return out;
}

MemoryPlan plan_memory(const ModelMemory& model, const TrainingMemory& training,
                       int64_t budget_bytes) {
  MemoryPlan plan;
  plan.budget_bytes = budget_bytes;
  for (const auto& s : candidate_strategies(training.world_size)) {
    plan.estimates.push_back(estimate_memory(model, training, s));
  }
  return plan;
}

std::optional<int> min_world_size_for_full_shard(const ModelMemory& model, TrainingMemory training,
                                                 int64_t budget_bytes, int max_world_size) {
  const PlannedStrategy full{PlannedStrategy::Kind::kFsdp, ShardingStrategy::kFullShard, 0};
  for (int w = 1; w <= max_world_size; ++w) {
    training.world_size = w;
    if (estimate_memory(model, training, full).total() <= budget_bytes) return w;
  }
  return std::nullopt;
}

MemoryEstimate check_memory(const ModelMemory& model, const TrainingMemory& training,
                            const PlannedStrategy& requested, int64_t budget_bytes,
                            const std::string& budget_source) {
  const MemoryEstimate mine = estimate_memory(model, training, requested);
  if (mine.total() <= budget_bytes) return mine;
  const MemoryPlan plan = plan_memory(model, training, budget_bytes);
  std::vector<std::string> fitting;
  for (const auto& e : plan.estimates) {
    if (plan.fits(e)) {
      fitting.push_back(fmt::format("{} ({})", e.strategy.flags(), format_gib(e.total())));
    }
  }
  std::string way_out;
  if (!fitting.empty()) {
    way_out = fmt::format("Strategies that fit at world size {}: {}", training.world_size,
                          fmt::join(fitting, "; "));
  } else if (auto w = min_world_size_for_full_shard(model, training, budget_bytes)) {
    way_out = fmt::format(
        "No strategy fits at world size {}; --strategy fsdp --sharding full would from {} ranks "
        "(or fewer activations: a smaller batch, activation checkpointing)",
        training.world_size, *w);
  } else {
    way_out = fmt::format(
        "No strategy fits at any world size: activations and the runtime alone need {} per rank "
        "(a smaller batch or sequence, or activation checkpointing)",
        format_gib(model.activation_bytes + training.runtime_bytes));
  }
  throw InvalidArgument(fmt::format(
      "memory: {} at world size {} needs an estimated {} per rank, more than the {} available "
      "per rank ({}). {}. The arithmetic: docs/strategies.md, \"Memory per rank\".",
      requested.flags(), training.world_size, mine.to_string(), format_gib(budget_bytes),
      budget_source, way_out));
}

std::string format_gib(int64_t bytes) { return fmt::format("{:.2f} GiB", gib(bytes)); }

}  // namespace dtrain

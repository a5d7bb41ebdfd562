// The memory planner's run-time side: before the model is built, the estimate of this run's
// peak memory per rank (memory_estimate.h, dtrain/memory_plan.h) against the memory a rank
// has. --strategy auto takes the first strategy that fits; any other run that cannot fit is
// refused here, with the estimate, the budget and what would fit.
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "cuda_memory.h"
#include "dtrain/memory_plan.h"
#include "memory_estimate.h"
#include "trainer.h"

namespace gpt2 {
namespace {

dtrain::PlannedStrategy requested_strategy(const Config& c, int local_world_size) {
  using Kind = dtrain::PlannedStrategy::Kind;
  switch (c.strategy) {
    case StrategyKind::kSingle:
      return {Kind::kSingle, c.sharding, 0};
    case StrategyKind::kDdp:
      return {Kind::kDataParallel, c.sharding, 0};
    case StrategyKind::kFsdp:
      break;
  }
  const int group = c.shard_group_size > 0 ? c.shard_group_size : local_world_size;
  return {Kind::kFsdp, c.sharding, group};
}

}  // namespace

void Trainer::plan_memory() {
  // The budget: the flag, else the device's memory, else the host's share per local rank.
  int64_t budget = c_.memory_per_rank;
  std::string source = "--memory_per_rank";
  if (budget == 0 && device_.is_cuda()) {
    budget = cuda_total_bytes(device_.index()).value_or(0);
    source = "the memory of " + device_.str();
  } else if (budget == 0) {
    const dtrain::HostMemoryInfo host = dtrain::read_host_memory();
    const auto available = host.available();
    budget = available ? *available / std::max(1, info_.local_world_size) : 0;
    source =
        fmt::format("{}, shared by {} local rank(s)", host.to_string(), info_.local_world_size);
  }
  // Every rank must decide the same: the least budget over the ranks (a host's
  // MemAvailable moves while its ranks start); unknown on a rank counts as no limit there.
  if (comm_ && info_.world_size > 1) {
    const double mine =
        budget > 0 ? static_cast<double>(budget) : std::numeric_limits<double>::max();
    at::Tensor t = at::full({1}, mine, at::TensorOptions().dtype(at::kDouble)).to(comm_->device());
    comm_->all_reduce_sync(t, dtrain::ReduceOp::kMin);
    const double least = t.cpu().item<double>();
    const int64_t agreed = least >= static_cast<double>(std::numeric_limits<int64_t>::max())
                               ? 0
                               : static_cast<int64_t>(least);
    if (agreed != budget) source += "; the least over the ranks";
    budget = agreed;
  }
  if (budget <= 0) {
    check(!c_.strategy_auto, "--strategy auto: no memory figure is known here (" + source +
                                 "); pass --memory_per_rank GIB or a strategy");
    say("memory: no memory figure is known (" + source +
        "); the run is not checked against one (--memory_per_rank GIB sets it)");
    return;
  }

  const dtrain::ModelMemory model = model_memory(c_, embedding_rows(c_, token_ids_));
  const dtrain::TrainingMemory training = training_memory(c_, info_.world_size);
  if (!c_.strategy_auto) {
    const dtrain::PlannedStrategy requested = requested_strategy(c_, info_.local_world_size);
    // A hybrid group that does not divide the world is refused by the strategy's set-up.
    if (requested.kind == dtrain::PlannedStrategy::Kind::kFsdp &&
        requested.sharding == dtrain::ShardingStrategy::kHybridShard &&
        info_.world_size % requested.shard_group_size != 0) {
      return;
    }
    const dtrain::MemoryEstimate e =
        dtrain::check_memory(model, training, requested, budget, source);
    say(fmt::format("memory: estimated peak {} per rank, {} available ({})", e.to_string(),
                    dtrain::format_gib(budget), source));
    return;
  }
  const dtrain::MemoryPlan plan = dtrain::plan_memory(model, training, budget);
  const auto choice = plan.choice();
  if (!choice) {
    // Refused with the message of the most sharded candidate (the last), which throws.
    dtrain::check_memory(model, training, plan.estimates.back().strategy, budget, source);
    return;
  }
  const dtrain::PlannedStrategy& s = choice->strategy;
  switch (s.kind) {
    case dtrain::PlannedStrategy::Kind::kSingle:
      c_.strategy = StrategyKind::kSingle;
      break;
    case dtrain::PlannedStrategy::Kind::kDataParallel:
      c_.strategy = StrategyKind::kDdp;
      break;
    case dtrain::PlannedStrategy::Kind::kFsdp:
      c_.strategy = StrategyKind::kFsdp;
      c_.sharding = s.sharding;
      c_.shard_group_size = s.shard_group_size;
      break;
  }
  std::string estimates = plan.summary();
  if (!estimates.empty() && estimates.back() == '\n') estimates.pop_back();
  say(
      fmt::format("memory: --strategy auto chose {} ({} per rank available: {}); estimates "
                  "per rank:\n{}",
                  s.flags(), dtrain::format_gib(budget), source, estimates));
}

}  // namespace gpt2

// Memory per rank, foreseen: an estimate of a training run's peak memory on each rank, made
// from the parameter count, the strategy, the precision, the optimizer and the activations
// before the model is built, and the plan that compares it with what a rank has.
//
// clang-format off
//   dtrain::ModelMemory model;                         // what the model is
//   model.parameters = 774'030'080;
//   model.units = {64'328'960, 19'677'440};            // FSDP units (wrap policy), if any
//   model.activation_bytes = my_activation_estimate(batch);
//   dtrain::TrainingMemory training;                   // how it is trained
//   training.world_size = 4;
//   const int64_t budget = dtrain::default_memory_per_rank(/*local ranks*/ 4).value();
//   dtrain::MemoryPlan plan = dtrain::plan_memory(model, training, budget);
//   if (auto choice = plan.choice()) build(choice->strategy);  // "auto"
//   dtrain::check_memory(model, training, requested, budget,   // or refuse
//                        "MemAvailable shared by 4 ranks");
// clang-format on
//
// The arithmetic (bytes per parameter for each strategy, and a rule of thumb) is in
// docs/strategies.md, "Memory per rank". Everything here is pure except
// read_host_memory() / default_memory_per_rank(), which read /proc and the cgroup files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/fsdp.h"

namespace dtrain {

// What a LibTorch process holds besides the model's tensors: the libraries' code and data,
// the allocator's and BLAS's buffers, the data pipeline. Peak RSS of gpt2_train runs in
// docs/benchmarks-history.md minus their model state and estimated activations left 150 to 320 MiB
// (docs/strategies.md, "Memory per rank").
inline constexpr int64_t kCpuRuntimeBytes = int64_t{256} << 20;

// The model, as the estimate sees it (counts, not tensors: nothing needs to be built).
struct ModelMemory {
  // Trainable parameters of the whole model.
  int64_t parameters = 0;
  // FSDP: the parameters of each unit the wrap policy makes (not the root), in any order;
  // empty: the whole model is the root unit.
  std::vector<int64_t> units;
  // Bytes of activations one rank keeps for backward at their peak, for one micro-batch,
  // in the compute dtype, including the loss's buffers: the model's own estimate.
  int64_t activation_bytes = 0;
};

// How it is trained.
struct TrainingMemory {
  int world_size = 1;
  // Bytes per element of what the module computes with: 4 (fp32), 2 (bf16 or fp16: autocast
  // under single and DDP, FSDP's param_dtype). Master weights, gradients and optimizer
  // state stay fp32 either way.
  int64_t compute_bytes = 4;
  // fp32 values the optimizer keeps per parameter: AdamW 2 (both moments), SGD with
  // momentum 1, plain SGD 0.
  int64_t optimizer_states = 2;
  // Several micro-batches per step with gradient sync off (Strategy::no_sync): FSDP then
  // holds unsharded fp32 gradients of the whole model (docs/strategies.md, "Gradient
  // accumulation"); DDP accumulates in its buckets (no extra).
  bool accumulates = false;
  // DataParallel: bucket cap (DataParallelOptions::bucket_cap_mb), the scratch of a bucket
  // in flight.
  int64_t bucket_bytes = int64_t{25} << 20;
  // FSDP FULL_SHARD / HYBRID_SHARD: units gathered at once besides the root, the largest
  // assumed: the one running and one more (in forward a unit kept gathered between its calls,
  // FsdpOptions::keep_gathered_between_calls; in backward the next one, prefetched). One more
  // with FsdpOptions::forward_prefetch.
  int gathered_units = 2;
  // Per process, independent of the model (kCpuRuntimeBytes on the CPU; on a GPU the
  // CUDA context and allocator reserve, which the device budget must also hold).
  int64_t runtime_bytes = kCpuRuntimeBytes;
  // FSDP with FsdpOptions::cpu_offload, the module on an accelerator: the fp32 shards, their
  // gradients and the optimizer's state live in host memory. The estimate (the device's
  // bytes) then leaves them out and MemoryEstimate::host_bytes counts them. Leave it false
  // for a module on the CPU, where offload changes nothing. Ignored by single and DDP.
  bool cpu_offload = false;
};

// A strategy as the planner names and builds it.
struct PlannedStrategy {
  enum class Kind { kSingle, kDataParallel, kFsdp };
  Kind kind = Kind::kSingle;
  // kFsdp: the sharding strategy; kHybridShard shards over groups of shard_group_size ranks.
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  int shard_group_size = 0;

  // Ranks the parameters' fp32 state is sharded over at `world_size` (1: not sharded).
  int shard_size(int world_size) const;
  // gpt2_train's flags for it: "--strategy single", "--strategy ddp", "--strategy fsdp
  // --sharding full", "--strategy fsdp --sharding hybrid --shard_group_size 2", ...
  std::string flags() const;
  bool operator==(const PlannedStrategy& o) const;
};

// One strategy's estimated peak bytes per rank, by part.
struct MemoryEstimate {
  PlannedStrategy strategy;
  int64_t parameter_bytes = 0;   // fp32 parameters, or this rank's fp32 shards
  int64_t gathered_bytes = 0;    // compute-dtype copies: FSDP's gathered units, autocast's cache
  int64_t gradient_bytes = 0;    // fp32 gradients (or shards), plus a unit's unsharded one
  int64_t optimizer_bytes = 0;   // the optimizer's state
  int64_t buffer_bytes = 0;      // DDP's bucket in flight; FSDP's held accumulation gradients
  int64_t activation_bytes = 0;  // ModelMemory::activation_bytes
  int64_t runtime_bytes = 0;     // TrainingMemory::runtime_bytes
  // TrainingMemory::cpu_offload: the fp32 shards, their gradients and the optimizer's state,
  // in host memory. Not part of total(), which is what the budget (the device's) must hold.
  int64_t host_bytes = 0;
  int64_t total() const;
  // "3.21 GiB (parameters 0.72, gathered 0.39, gradients 0.96, optimizer 1.44, ...)", with
  // offload "... GiB; host memory 2.88 GiB)"
  std::string to_string() const;
};

// The estimate for `strategy` (docs/strategies.md, "Memory per rank", has the formulas).
// Throws InvalidArgument for a non-positive world size, negative counts, or a hybrid shard
// group size that does not divide the world size.
MemoryEstimate estimate_memory(const ModelMemory& model, const TrainingMemory& training,
                               const PlannedStrategy& strategy);

// The strategies worth trying at `world_size`, fastest first: single at one rank; else
// DDP, FSDP SHARD_GRAD_OP, FSDP HYBRID_SHARD with shard groups of each divisor g of the
// world size (1 < g < world, smallest first), FSDP FULL_SHARD: from the least sharding
// (least communication) to the most.
std::vector<PlannedStrategy> candidate_strategies(int world_size);

struct MemoryPlan {
  int64_t budget_bytes = 0;               // memory per rank
  std::vector<MemoryEstimate> estimates;  // candidate_strategies' order
  bool fits(const MemoryEstimate& e) const { return e.total() <= budget_bytes; }
  // The first estimate within the budget (what "auto" runs); nullopt when none fits.
  std::optional<MemoryEstimate> choice() const;
  // One line per candidate: its flags, its estimate, "fits" or "does not fit".
  std::string summary() const;
};

// Estimates every candidate at training.world_size against `budget_bytes` per rank.
MemoryPlan plan_memory(const ModelMemory& model, const TrainingMemory& training,
                       int64_t budget_bytes);

// Smallest world size, up to `max_world_size`, at which FSDP FULL_SHARD fits the budget
// (activations per rank unchanged); nullopt when none does.
std::optional<int> min_world_size_for_full_shard(const ModelMemory& model, TrainingMemory training,
                                                 int64_t budget_bytes, int max_world_size = 1024);

// Refuses a run that cannot fit: throws InvalidArgument when `requested`'s estimate exceeds
// the budget. The message names the estimate (with its parts), the memory available per
// rank and where that figure comes from (`budget_source`), and the strategies that fit at
// this world size, or, when none does, from how many ranks FSDP full sharding would.
// Returns the estimate otherwise.
MemoryEstimate check_memory(const ModelMemory& model, const TrainingMemory& training,
                            const PlannedStrategy& requested, int64_t budget_bytes,
                            const std::string& budget_source);

// ---- Memory available ------------------------------------------------------------------

// This machine's memory as the kernel reports it.
struct HostMemoryInfo {
  std::optional<int64_t> mem_available;  // /proc/meminfo MemAvailable
  std::optional<int64_t> cgroup_limit;   // this process's cgroup memory limit, when it has one
  // min(MemAvailable, cgroup limit), or whichever is known; nullopt when neither is.
  std::optional<int64_t> available() const;
  // "MemAvailable 15.20 GiB, cgroup limit 8.00 GiB"
  std::string to_string() const;
};

// MemAvailable (bytes) from /proc/meminfo's text; nullopt when absent or malformed.
std::optional<int64_t> parse_meminfo_available(const std::string& meminfo);
// A cgroup memory limit file's text (v2 memory.max, v1 memory.limit_in_bytes): nullopt for
// "max", for v1's "no limit" (a value near INT64_MAX) and for malformed text.
std::optional<int64_t> parse_cgroup_limit(const std::string& text);
// Reads /proc/meminfo and the limit of this process's memory cgroup (v2, or v1's memory
// controller), as /proc/self/cgroup names it.
HostMemoryInfo read_host_memory();

// The CPU budget per rank: read_host_memory().available() shared equally among
// `local_ranks` processes; nullopt when the machine reports neither figure.
std::optional<int64_t> default_memory_per_rank(int local_ranks);

// "1.50 GiB"
std::string format_gib(int64_t bytes);

}  // namespace dtrain

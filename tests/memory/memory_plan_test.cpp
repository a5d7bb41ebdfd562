// The memory planner: its arithmetic on a model small enough to check by hand, the order in
// which "auto" tries strategies, the refusal and its message, and the host memory readers.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/memory_plan.h"

namespace dtrain {
namespace {

using Kind = PlannedStrategy::Kind;

const PlannedStrategy kSingle{Kind::kSingle, ShardingStrategy::kFullShard, 0};
const PlannedStrategy kDdp{Kind::kDataParallel, ShardingStrategy::kFullShard, 0};
const PlannedStrategy kFull{Kind::kFsdp, ShardingStrategy::kFullShard, 0};
const PlannedStrategy kGradOp{Kind::kFsdp, ShardingStrategy::kShardGradOp, 0};
const PlannedStrategy kNoShard{Kind::kFsdp, ShardingStrategy::kNoShard, 0};
PlannedStrategy hybrid(int g) { return {Kind::kFsdp, ShardingStrategy::kHybridShard, g}; }

// 1000 parameters: units of 300, 100, 100 and 100, so the root holds 400.
ModelMemory model() {
  ModelMemory m;
  m.parameters = 1000;
  m.units = {100, 300, 100, 100};
  m.activation_bytes = 500;
  return m;
}

TrainingMemory training(int world) {
  TrainingMemory t;
  t.world_size = world;
  t.runtime_bytes = 1000;
  t.gathered_units = 3;  // the 3 largest units: 300, 100, 100
  return t;
}

TEST(MemoryPlan, SingleIsSixteenBytesPerParameterWithAdamW) {
  const MemoryEstimate e = estimate_memory(model(), training(1), kSingle);
  EXPECT_EQ(e.parameter_bytes, 4000);
  EXPECT_EQ(e.gradient_bytes, 4000);
  EXPECT_EQ(e.optimizer_bytes, 8000);
  EXPECT_EQ(e.gathered_bytes, 0);
  EXPECT_EQ(e.buffer_bytes, 0);
  EXPECT_EQ(e.activation_bytes, 500);
  EXPECT_EQ(e.runtime_bytes, 1000);
  EXPECT_EQ(e.total(), 17500);
  // bf16 autocast adds its cache of bf16 weights; SGD without momentum keeps no state.
  TrainingMemory t = training(1);
  t.compute_bytes = 2;
  t.optimizer_states = 0;
  const MemoryEstimate b = estimate_memory(model(), t, kSingle);
  EXPECT_EQ(b.gathered_bytes, 2000);
  EXPECT_EQ(b.optimizer_bytes, 0);
  EXPECT_EQ(b.total(), 4000 + 2000 + 4000 + 500 + 1000);
}

TEST(MemoryPlan, DdpAddsOneBucketCappedByTheGradients) {
  EXPECT_EQ(estimate_memory(model(), training(4), kDdp).total(), 17500 + 4000);
  TrainingMemory t = training(4);
  t.bucket_bytes = 1500;
  const MemoryEstimate e = estimate_memory(model(), t, kDdp);
  EXPECT_EQ(e.buffer_bytes, 1500);
  EXPECT_EQ(e.total(), 17500 + 1500);
}

TEST(MemoryPlan, FullShardDividesTheStateAndGathersTheRootAndTheLargestUnits) {
  const MemoryEstimate e = estimate_memory(model(), training(4), kFull);
  EXPECT_EQ(e.parameter_bytes, 1000);           // 250 fp32 per rank
  EXPECT_EQ(e.optimizer_bytes, 2000);           // two moments
  EXPECT_EQ(e.gradient_bytes, 1000 + 4 * 400);  // the shard's, and the root's unsharded one
  EXPECT_EQ(e.gathered_bytes, 4 * (400 + 300 + 100 + 100));
  EXPECT_EQ(e.total(), 1000 + 2000 + 2600 + 3600 + 500 + 1000);
  // One more unit gathered at once: all of them.
  TrainingMemory t = training(4);
  t.gathered_units = 4;
  EXPECT_EQ(estimate_memory(model(), t, kFull).gathered_bytes, 4000);
  // bf16 parameters gather half the bytes and reduce a bf16 gradient.
  t = training(4);
  t.compute_bytes = 2;
  const MemoryEstimate b = estimate_memory(model(), t, kFull);
  EXPECT_EQ(b.gathered_bytes, 2 * 900);
  EXPECT_EQ(b.gradient_bytes, 1000 + 2 * 400);
  // Gradient accumulation without sync holds the whole model's fp32 gradient.
  t = training(4);
  t.accumulates = true;
  EXPECT_EQ(estimate_memory(model(), t, kFull).buffer_bytes, 4000);
  EXPECT_EQ(estimate_memory(model(), t, kDdp).buffer_bytes, 4000);  // its bucket, no more
}

TEST(MemoryPlan, GradOpHybridAndNoShard) {
  // SHARD_GRAD_OP keeps the whole model gathered through backward.
  EXPECT_EQ(estimate_memory(model(), training(4), kGradOp).gathered_bytes, 4000);
  // HYBRID_SHARD shards over its group only.
  const MemoryEstimate h = estimate_memory(model(), training(4), hybrid(2));
  EXPECT_EQ(h.parameter_bytes, 2000);
  EXPECT_EQ(h.optimizer_bytes, 4000);
  EXPECT_EQ(h.total(), 2000 + 4000 + (2000 + 1600) + 3600 + 500 + 1000);
  // NO_SHARD in fp32 shares the parameters with the shard: DDP's state, no second copy.
  const MemoryEstimate n = estimate_memory(model(), training(4), kNoShard);
  EXPECT_EQ(n.parameter_bytes, 4000);
  EXPECT_EQ(n.gathered_bytes, 0);
  EXPECT_EQ(n.optimizer_bytes, 8000);
  TrainingMemory t = training(4);
  t.compute_bytes = 2;
  EXPECT_EQ(estimate_memory(model(), t, kNoShard).gathered_bytes, 2000);
}

// CPU offload: the fp32 shards, their gradients and AdamW's moments leave the device's
// estimate for host memory; the device keeps the gathered units (unsharded fp32 even where
// the shard shared their memory), a unit's unsharded gradient and one unit's shard in transit.
TEST(MemoryPlan, CpuOffloadMovesTheFp32StateToHostMemory) {
  TrainingMemory t = training(4);
  t.cpu_offload = true;
  const MemoryEstimate e = estimate_memory(model(), t, kFull);
  EXPECT_EQ(e.parameter_bytes, 0);
  EXPECT_EQ(e.optimizer_bytes, 0);
  EXPECT_EQ(e.gradient_bytes, 4 * 400 + 4 * 100);  // the root's gradient, its reduced shard
  EXPECT_EQ(e.gathered_bytes, 4 * (400 + 300 + 100 + 100) + 4 * 100);  // + the root's shard
  EXPECT_EQ(e.host_bytes, 1000 + 1000 + 2000);  // shard, its gradient, two moments
  EXPECT_EQ(e.total(), 2000 + 4000 + 500 + 1000);
  EXPECT_LT(e.total(), estimate_memory(model(), training(4), kFull).total());
  EXPECT_NE(e.to_string().find("; host memory 0.00 GiB)"), std::string::npos) << e.to_string();
  // NO_SHARD: the device now needs its own fp32 copy of the whole model.
  const MemoryEstimate n = estimate_memory(model(), t, kNoShard);
  EXPECT_EQ(n.gathered_bytes, 4000 + 4 * 400);
  EXPECT_EQ(n.host_bytes, 4000 + 4000 + 8000);
  // Strategies without shards ignore it; without offload there is no host term.
  const MemoryEstimate d = estimate_memory(model(), t, kDdp);
  EXPECT_EQ(d.host_bytes, 0);
  EXPECT_EQ(d.total(), estimate_memory(model(), training(4), kDdp).total());
  EXPECT_EQ(estimate_memory(model(), training(4), kFull).host_bytes, 0);
  EXPECT_EQ(estimate_memory(model(), training(4), kFull).to_string().find("host"),
            std::string::npos);
  // A budget full sharding misses without offload fits it with offload (grad_op: 7900).
  EXPECT_FALSE(plan_memory(model(), training(4), 7600).choice().has_value());
  EXPECT_EQ(plan_memory(model(), t, 7600).choice()->strategy, kFull);
}

TEST(MemoryPlan, ShardingNeverCostsMoreStateThanFewerRanks) {
  ModelMemory m;
  m.parameters = 774'030'080;  // GPT-2 large
  m.units.assign(36, 19'677'440);
  m.units.push_back(64'328'960);
  int64_t last = estimate_memory(m, training(1), kSingle).total();
  for (int w : {2, 4, 8, 16}) {
    const int64_t now = estimate_memory(m, training(w), kFull).total();
    EXPECT_LT(now, last) << w;
    last = now;
  }
}

TEST(MemoryPlan, BadInputsAreRefused) {
  EXPECT_THROW(estimate_memory(model(), training(0), kDdp), InvalidArgument);
  EXPECT_THROW(estimate_memory(model(), training(2), kSingle), InvalidArgument);
  EXPECT_THROW(estimate_memory(model(), training(4), hybrid(3)), InvalidArgument);
  ModelMemory m = model();
  m.parameters = -1;
  EXPECT_THROW(estimate_memory(m, training(1), kSingle), InvalidArgument);
}

TEST(MemoryPlan, CandidatesGoFromLeastToMostSharding) {
  const auto one = candidate_strategies(1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].flags(), "--strategy single");
  std::vector<std::string> six;
  for (const auto& s : candidate_strategies(6)) six.push_back(s.flags());
  EXPECT_EQ(six, (std::vector<std::string>{"--strategy ddp", "--strategy fsdp --sharding grad_op",
                                           "--strategy fsdp --sharding hybrid --shard_group_size 2",
                                           "--strategy fsdp --sharding hybrid --shard_group_size 3",
                                           "--strategy fsdp --sharding full"}));
}

TEST(MemoryPlan, AutoPicksTheFirstThatFits) {
  // At 4 ranks: ddp 21500, grad_op 11100, hybrid/2 14700, full 10700.
  EXPECT_EQ(plan_memory(model(), training(4), 30000).choice()->strategy, kDdp);
  EXPECT_EQ(plan_memory(model(), training(4), 21000).choice()->strategy, kGradOp);
  EXPECT_EQ(plan_memory(model(), training(4), 11000).choice()->strategy, kFull);
  EXPECT_FALSE(plan_memory(model(), training(4), 10600).choice().has_value());
  EXPECT_EQ(plan_memory(model(), training(1), 17500).choice()->strategy, kSingle);
  const std::string summary = plan_memory(model(), training(4), 21000).summary();
  EXPECT_NE(summary.find("--strategy ddp: "), std::string::npos) << summary;
  EXPECT_NE(summary.find("does not fit"), std::string::npos) << summary;
}

TEST(MemoryPlan, ARunThatCannotFitIsRefusedNamingEstimateBudgetAndWhatFits) {
  EXPECT_EQ(check_memory(model(), training(4), kDdp, 30000, "test").total(), 21500);
  try {
    check_memory(model(), training(4), kDdp, 12000, "given by the test");
    FAIL() << "ddp at 21500 bytes accepted within 12000";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--strategy ddp at world size 4 needs an estimated 0.00 GiB"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("available per rank (given by the test)"), std::string::npos) << m;
    EXPECT_NE(m.find("Strategies that fit at world size 4: --strategy fsdp --sharding grad_op"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("--strategy fsdp --sharding full"), std::string::npos) << m;
    EXPECT_EQ(m.find("hybrid"), std::string::npos) << "hybrid/2 needs 14700: " << m;
  }
  // None fits at 2 ranks (full sharding: 14700); it would from 4 (10700; 3 ranks: 12044).
  try {
    check_memory(model(), training(2), kFull, 10700, "test");
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "No strategy fits at world size 2; --strategy fsdp --sharding full would from "
                  "4 ranks"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(min_world_size_for_full_shard(model(), training(1), 10700), 4);
  // Activations and runtime alone exceed it: no number of ranks helps.
  EXPECT_FALSE(min_world_size_for_full_shard(model(), training(1), 1400).has_value());
  EXPECT_THROW(check_memory(model(), training(1), kSingle, 1400, "test"), InvalidArgument);
}

TEST(MemoryPlan, GibbibytesInMessages) {
  EXPECT_EQ(format_gib(int64_t{3} << 29), "1.50 GiB");
  MemoryEstimate e;
  e.parameter_bytes = int64_t{1} << 30;
  e.runtime_bytes = int64_t{1} << 29;
  EXPECT_EQ(e.to_string(),
            "1.50 GiB (parameters 1.00, gradients 0.00, optimizer 0.00, activations 0.00, "
            "runtime 0.50 GiB)");
}

TEST(HostMemory, MeminfoAndCgroupLimitsParse) {
  EXPECT_EQ(parse_meminfo_available("MemTotal:       24000000 kB\nMemFree:  1 kB\n"
                                    "MemAvailable:   16000000 kB\nBuffers: 2 kB\n"),
            int64_t{16000000} * 1024);
  EXPECT_FALSE(parse_meminfo_available("MemTotal: 5 kB\n").has_value());
  EXPECT_FALSE(parse_meminfo_available("MemAvailable: lots\n").has_value());
  EXPECT_EQ(parse_cgroup_limit("8589934592\n"), int64_t{8} << 30);
  EXPECT_FALSE(parse_cgroup_limit("max\n").has_value());
  EXPECT_FALSE(parse_cgroup_limit("9223372036854771712\n").has_value());  // v1: no limit
  EXPECT_FALSE(parse_cgroup_limit("-1").has_value());
  EXPECT_FALSE(parse_cgroup_limit("12x").has_value());
  HostMemoryInfo info;
  EXPECT_FALSE(info.available().has_value());
  info.mem_available = 10;
  EXPECT_EQ(info.available(), 10);
  info.cgroup_limit = 4;
  EXPECT_EQ(info.available(), 4);
  info.mem_available = 2;
  EXPECT_EQ(info.available(), 2);
}

TEST(HostMemory, ThisMachineReportsMemoryAndRanksShareIt) {
  const HostMemoryInfo info = read_host_memory();
  ASSERT_TRUE(info.mem_available.has_value()) << "no MemAvailable in /proc/meminfo";
  EXPECT_GT(*info.mem_available, 0);
  const auto one = default_memory_per_rank(1), four = default_memory_per_rank(4);
  ASSERT_TRUE(one && four);
  // Read at different moments: equal shares up to what other processes did in between.
  EXPECT_NEAR(static_cast<double>(*four), static_cast<double>(*one) / 4,
              static_cast<double>(*one) * 0.05);
  EXPECT_NE(info.to_string().find("MemAvailable "), std::string::npos);
}

}  // namespace
}  // namespace dtrain

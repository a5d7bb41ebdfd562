// FsdpOptions::reshard_after_forward: kHost (parameters sharded only within the host between
// a unit's forward and its backward) trains bit for bit like kAll (freed over every rank), 4
// ranks as 2 hosts of 2, as threads and as processes; backward's gathers stay inside the
// host; the options are checked.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/inspect.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

struct TrainedRun {
  std::vector<std::pair<std::string, at::Tensor>> state;  // rank 0's full_state_dict
  std::vector<std::string> log;                           // rank 0's last step
};

// `world` ranks, hosts of `host` consecutive ranks (the shard groups of make_hybrid_groups
// serve as host groups), FULL_SHARD or HYBRID_SHARD over them.
TrainedRun train_with(ShardingStrategy sharding, std::optional<ReshardAfterForward> after,
                      int world, int host, bool accumulate) {
  at::set_num_threads(1);
  Case c;
  c.model = Model::kTransformer;
  c.opt = Opt::kAdamW;
  c.accumulate = accumulate;
  const auto data = make_data(c.model, world);
  auto modules = rank_models(c.model, world);
  TrainedRun run;
  run_with_groups(world, host, [&](Communicator& comm, const HybridGroups& g) {
    const int r = comm.rank();
    FsdpOptions o;
    o.sharding = sharding;
    o.wrap_policy = blocks_and_nested_up();
    o.reshard_after_forward = after;
    o.host_group = g.shard_group;
    if (sharding == ShardingStrategy::kHybridShard) {
      o.shard_group = g.shard_group;
      o.replicate_group = g.replicate_group;
    }
    FullyShardedDataParallel fsdp(modules[r],
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    train(c, fsdp, *modules[r], data, r * kLocalBatch, kLocalBatch, &fsdp);
    auto state = fsdp.full_state_dict();
    if (r == 0) {
      run.state = std::move(state);
      run.log = detail::Inspect::last_collective_log(fsdp);
    }
  });
  return run;
}

void expect_identical(const TrainedRun& a, const TrainedRun& b) {
  ASSERT_EQ(a.state.size(), b.state.size());
  ASSERT_FALSE(a.state.empty());
  for (size_t i = 0; i < a.state.size(); ++i) {
    EXPECT_EQ(a.state[i].first, b.state[i].first);
    EXPECT_TRUE(at::equal(a.state[i].second, b.state[i].second))
        << a.state[i].first << " max |diff| "
        << (a.state[i].second - b.state[i].second).abs().max().item<double>();
  }
}

size_t count_prefix(const std::vector<std::string>& log, const std::string& prefix) {
  return static_cast<size_t>(std::count_if(log.begin(), log.end(), [&](const std::string& e) {
    return e.compare(0, prefix.size(), prefix) == 0;
  }));
}

TEST(FsdpReshardAfterForward, HostMatchesAllExactlyOnTwoHostsOfTwo) {
  for (bool accumulate : {false, true}) {
    const TrainedRun all =
        train_with(ShardingStrategy::kFullShard, ReshardAfterForward::kAll, 4, 2, accumulate);
    const TrainedRun host =
        train_with(ShardingStrategy::kFullShard, ReshardAfterForward::kHost, 4, 2, accumulate);
    SCOPED_TRACE(accumulate ? "with accumulation" : "one micro-batch");
    expect_identical(all, host);
    // kAll gathers over every rank in backward; kHost only inside the host, and exactly once
    // per non-root unit (the root stays gathered through the step).
    EXPECT_EQ(count_prefix(all.log, "all_gather_host:"), 0u);
    EXPECT_GT(count_prefix(host.log, "all_gather_host:"), 0u);
    EXPECT_LT(count_prefix(host.log, "all_gather:"), count_prefix(all.log, "all_gather:"));
    EXPECT_EQ(count_prefix(host.log, "all_gather:") + count_prefix(host.log, "all_gather_host:"),
              count_prefix(all.log, "all_gather:"));
  }
}

// The default keeps the strategy's semantics: FULL_SHARD frees (kAll), SHARD_GRAD_OP keeps
// (kNone); setting one is the other strategy.
TEST(FsdpReshardAfterForward, UnsetKeepsTheStrategysMeaning) {
  const TrainedRun full = train_with(ShardingStrategy::kFullShard, std::nullopt, 2, 0, false);
  const TrainedRun full_none =
      train_with(ShardingStrategy::kFullShard, ReshardAfterForward::kNone, 2, 0, false);
  const TrainedRun grad_op = train_with(ShardingStrategy::kShardGradOp, std::nullopt, 2, 0, false);
  const TrainedRun grad_op_all =
      train_with(ShardingStrategy::kShardGradOp, ReshardAfterForward::kAll, 2, 0, false);
  expect_identical(full, grad_op);
  EXPECT_EQ(full.log, grad_op_all.log);
  EXPECT_EQ(full_none.log, grad_op.log);
  EXPECT_NE(full.log, grad_op.log);
}

// HYBRID_SHARD whose shard group is the host: kHost gathers inside it as kAll does, exactly.
TEST(FsdpReshardAfterForward, HostUnderHybridShardMatches) {
  const TrainedRun all = train_with(ShardingStrategy::kHybridShard, std::nullopt, 4, 2, false);
  const TrainedRun host =
      train_with(ShardingStrategy::kHybridShard, ReshardAfterForward::kHost, 4, 2, false);
  expect_identical(all, host);
}

// The same as real processes over the TCP store: 4 ranks, LOCAL_WORLD_SIZE 2 (two "hosts"),
// each host group built by make_host_group from the launcher's numbering.
TEST(FsdpReshardAfterForward, HostMatchesAllExactlyInFourProcesses) {
  auto run_job = [](const std::string& scenario) {
    constexpr int kWorld = 4, kPerHost = 2;
    const int port = free_port();
    const std::string out =
        ::testing::TempDir() + "dtrain_" + scenario + "_" + std::to_string(port) + ".bin";
    std::vector<Process> ps;
    for (int r = 0; r < kWorld; ++r) {
      auto env = rank_env(r, kWorld, port);
      env["LOCAL_RANK"] = std::to_string(r % kPerHost);
      env["LOCAL_WORLD_SIZE"] = std::to_string(kPerHost);
      ps.push_back(spawn_process({DTRAIN_TEST_WORKER, scenario, "60000", out}, env));
    }
    for (int r = 0; r < kWorld; ++r) {
      auto res = wait_process(ps[r], 300);
      DTRAIN_CHECK(res.exit_code == 0, "{} rank {}:\n{}", scenario, r, res.output);
    }
    std::ifstream in(out, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::remove(out.c_str());
    return bytes;
  };
  const std::string all = run_job("fsdp_reshard_all");
  const std::string host = run_job("fsdp_reshard_host");
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.size(), host.size());
  EXPECT_TRUE(all == host) << "kHost's parameters differ from kAll's";
}

TEST(FsdpReshardAfterForward, RefusesWhatCannotWork) {
  // `host`: ranks per host group given to the strategy (0: none).
  auto expect_refused = [&](FsdpOptions o, int host, const std::string& want) {
    run_with_groups(4, host, [&](Communicator& comm, const HybridGroups& g) {
      FsdpOptions mine = o;  // per rank: the threads share `o`
      mine.host_group = g.shard_group;
      auto m = make_model(Model::kTransformer, 7);
      bool refused = false;
      try {
        FullyShardedDataParallel fsdp(m, std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
                                      mine);
      } catch (const InvalidArgument& e) {
        refused = true;
        DTRAIN_CHECK(std::string(e.what()).find(want) != std::string::npos,
                     "unexpected message: {}", e.what());
      }
      DTRAIN_CHECK(refused, "accepted; wanted '{}'", want);
    });
  };
  FsdpOptions host;
  host.reshard_after_forward = ReshardAfterForward::kHost;
  expect_refused(host, 0, "needs FsdpOptions::host_group");
  FsdpOptions no_shard;
  no_shard.sharding = ShardingStrategy::kNoShard;
  no_shard.reshard_after_forward = ReshardAfterForward::kAll;
  expect_refused(no_shard, 0, "NO_SHARD keeps every parameter");
}

}  // namespace
}  // namespace dtrain

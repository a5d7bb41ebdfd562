// DeviceMesh (dtrain/device_mesh.h): the groups of a replicate x shard layout and its hosts,
// made in one place; FSDP configured by one mesh trains exactly as with the deprecated
// per-option groups, refuses a mesh that contradicts its sharding strategy, and warns on the
// deprecated reshard_after_forward spellings that restate another strategy.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

#include "compat/warnings.h"
#include "dtrain/device_mesh.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// Runs fn(rank, world communicator, store) on `world` threads sharing one store.
void run_mesh_ranks(int world,
                    const std::function<void(int, CommunicatorPtr, std::shared_ptr<Store>)>& fn) {
  auto store = make_memory_store();
  run_threads(world, [&](int r) { fn(r, make_communicator(store, r, world), store); });
}

TEST(DeviceMesh, CreatesReplicateShardAndHostGroupsOfTheLayout) {
  run_mesh_ranks(4, [](int r, CommunicatorPtr world, std::shared_ptr<Store> store) {
    DeviceMeshOptions o;
    o.shard_size = 2;
    o.local_world_size = 2;
    const DeviceMesh mesh = DeviceMesh::create(store, world, o);
    DTRAIN_CHECK(mesh.ndim() == 2, "rank {}: ndim {}", r, mesh.ndim());
    // Shard groups {0,1} {2,3}; replicate groups {0,2} {1,3}; hosts {0,1} {2,3}.
    DTRAIN_CHECK(mesh.shard_group()->world_size() == 2 && mesh.shard_group()->rank() == r % 2,
                 "rank {}: shard group rank {} of {}", r, mesh.shard_group()->rank(),
                 mesh.shard_group()->world_size());
    DTRAIN_CHECK(
        mesh.replicate_group()->world_size() == 2 && mesh.replicate_group()->rank() == r / 2,
        "rank {}: replicate group rank {}", r, mesh.replicate_group()->rank());
    DTRAIN_CHECK(mesh.host_group()->world_size() == 2 && mesh.host_group()->rank() == r % 2,
                 "rank {}: host group rank {}", r, mesh.host_group()->rank());
    // The groups really are those ranks: a sum over each.
    at::Tensor t = at::full({1}, static_cast<float>(r));
    mesh.replicate_group()->all_reduce(t, ReduceOp::kSum)->wait();
    DTRAIN_CHECK(t.item<float>() == static_cast<float>(r % 2 + (r % 2 + 2)),
                 "rank {}: replicate sum {}", r, t.item<float>());
    at::Tensor u = at::full({1}, static_cast<float>(r));
    mesh.shard_group()->all_reduce(u, ReduceOp::kSum)->wait();
    DTRAIN_CHECK(u.item<float>() == static_cast<float>((r / 2) * 4 + 1), "rank {}: shard sum {}", r,
                 u.item<float>());
  });
}

TEST(DeviceMesh, OneDimensionalMeshShardsOverTheWorld) {
  run_mesh_ranks(2, [](int r, CommunicatorPtr world, std::shared_ptr<Store>) {
    const DeviceMesh mesh(world);
    DTRAIN_CHECK(mesh.ndim() == 1 && mesh.shard_group() == world && !mesh.replicate_group() &&
                     !mesh.host_group(),
                 "rank {}: not a bare 1-D mesh", r);
  });
}

TEST(DeviceMesh, SizesThatDoNotDivideTheWorldAreRefusedOnEveryRank) {
  std::atomic<int> refused{0};
  run_mesh_ranks(4, [&](int, CommunicatorPtr world, std::shared_ptr<Store> store) {
    DeviceMeshOptions o;
    o.shard_size = 3;
    try {
      DeviceMesh::create(store, world, o);
    } catch (const InvalidArgument& e) {
      if (std::string(e.what()).find("shard group size 3 does not divide world size 4") !=
          std::string::npos) {
        ++refused;
      }
    }
  });
  EXPECT_EQ(refused.load(), 4);
}

struct Trained {
  std::vector<std::pair<std::string, at::Tensor>> state;  // rank 0's full_state_dict
};

// HYBRID_SHARD (4 ranks, shard groups of 2) with kHost, configured by a mesh or by the
// deprecated FsdpOptions groups.
Trained train_hybrid(bool with_mesh) {
  at::set_num_threads(1);
  Case c;
  c.model = Model::kTransformer;
  c.opt = Opt::kAdamW;
  const auto data = make_data(c.model, 4);
  auto modules = rank_models(c.model, 4);
  Trained out;
  run_mesh_ranks(4, [&](int r, CommunicatorPtr world, std::shared_ptr<Store> store) {
    FsdpOptions o;
    o.sharding = ShardingStrategy::kHybridShard;
    o.wrap_policy = blocks_and_nested_up();
    o.reshard_after_forward = ReshardAfterForward::kHost;
    std::unique_ptr<FullyShardedDataParallel> fsdp;
    if (with_mesh) {
      DeviceMeshOptions mo;
      mo.shard_size = 2;
      mo.local_world_size = 2;
      fsdp = std::make_unique<FullyShardedDataParallel>(modules[r],
                                                        DeviceMesh::create(store, world, mo), o);
    } else {
      HybridGroups g = make_hybrid_groups(store, r, 4, 2);
      o.shard_group = g.shard_group;
      o.replicate_group = g.replicate_group;
      o.host_group = make_host_group(store, r, 4, 2);
      fsdp = std::make_unique<FullyShardedDataParallel>(modules[r], world, o);
    }
    train(c, *fsdp, *modules[r], data, r * kLocalBatch, kLocalBatch, fsdp.get());
    auto state = fsdp->full_state_dict();
    if (r == 0) out.state = std::move(state);
  });
  return out;
}

TEST(FsdpMesh, HybridShardOverAMeshTrainsExactlyAsOverTheDeprecatedGroups) {
  const Trained mesh = train_hybrid(true);
  const Trained groups = train_hybrid(false);
  ASSERT_EQ(mesh.state.size(), groups.state.size());
  ASSERT_FALSE(mesh.state.empty());
  for (size_t i = 0; i < mesh.state.size(); ++i) {
    EXPECT_EQ(mesh.state[i].first, groups.state[i].first);
    EXPECT_TRUE(at::equal(mesh.state[i].second, groups.state[i].second)) << mesh.state[i].first;
  }
}

// What FSDP says, on every rank, for a mesh that contradicts its options.
std::vector<std::string> refusals(ShardingStrategy sharding, int shard_size, bool host_in_options) {
  std::vector<std::string> messages(2);
  run_mesh_ranks(2, [&](int r, CommunicatorPtr world, std::shared_ptr<Store> store) {
    DeviceMeshOptions mo;
    mo.shard_size = shard_size;
    const DeviceMesh mesh = shard_size ? DeviceMesh::create(store, world, mo) : DeviceMesh(world);
    torch::manual_seed(1);
    auto model = torch::nn::Linear(4, 4);
    FsdpOptions o;
    o.sharding = sharding;
    if (host_in_options) o.host_group = make_host_group(store, r, 2, 2);
    try {
      FullyShardedDataParallel fsdp(model.ptr(), mesh, o);
    } catch (const InvalidArgument& e) {
      messages[static_cast<size_t>(r)] = e.what();
    }
  });
  return messages;
}

TEST(FsdpMesh, AMeshThatContradictsTheOptionsIsRefusedOnEveryRank) {
  for (const auto& m : refusals(ShardingStrategy::kFullShard, 1, false)) {
    EXPECT_NE(m.find("a 2-D mesh (replicate x shard) is HYBRID_SHARD's"), std::string::npos) << m;
  }
  for (const auto& m : refusals(ShardingStrategy::kHybridShard, 0, false)) {
    EXPECT_NE(m.find("HYBRID_SHARD needs a 2-D mesh"), std::string::npos) << m;
  }
  for (const auto& m : refusals(ShardingStrategy::kFullShard, 0, true)) {
    EXPECT_NE(m.find("the groups are given twice"), std::string::npos) << m;
  }
}

// FULL_SHARD + kNone (= SHARD_GRAD_OP) and SHARD_GRAD_OP + kAll (= FULL_SHARD) still work
// for one release, with a warning from rank 0 naming the spelling to use; the canonical
// spellings warn nothing.
TEST(FsdpMesh, DeprecatedShardingSpellingsWarnNamingTheCanonicalOne) {
  auto warnings = [](ShardingStrategy sharding, std::optional<ReshardAfterForward> after) {
    std::vector<std::string> rank0;
    run_mesh_ranks(2, [&](int r, CommunicatorPtr world, std::shared_ptr<Store>) {
      compat::WarningCapture capture;
      torch::manual_seed(1);
      auto model = torch::nn::Linear(4, 4);
      FsdpOptions o;
      o.sharding = sharding;
      o.reshard_after_forward = after;
      FullyShardedDataParallel fsdp(model.ptr(), DeviceMesh(world), o);
      if (r == 0) rank0 = capture.messages();
    });
    std::string all;
    for (const auto& w : rank0) all += w + "\n";
    return all;
  };
  EXPECT_NE(warnings(ShardingStrategy::kFullShard, ReshardAfterForward::kNone)
                .find("set ShardingStrategy::kShardGradOp instead"),
            std::string::npos);
  EXPECT_NE(warnings(ShardingStrategy::kShardGradOp, ReshardAfterForward::kAll)
                .find("set ShardingStrategy::kFullShard"),
            std::string::npos);
  EXPECT_EQ(warnings(ShardingStrategy::kShardGradOp, std::nullopt).find("deprecated"),
            std::string::npos);
  EXPECT_EQ(warnings(ShardingStrategy::kFullShard, ReshardAfterForward::kAll).find("deprecated"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain

// Deferred initialisation (dtrain/deferred_init.h): a model whose parameters hold no memory,
// FSDP computing only each rank's shard of their initial values, and single-device training
// initialised through init_parameters: the same values, bit for bit, at every world size and
// sharding strategy, and a step after it still matches single-device training.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <tuple>

#include "dtrain/deferred_init.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/training.h"
#include "support/check.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// Every kind of value from the generator: weights normal, biases uniform, norms around 1.
DeferredInit test_init(uint64_t seed = 11) {
  return DeferredInit{
      seed, [](const std::string& name, at::Tensor& p, at::Generator& gen) {
        if (name.find("ln") != std::string::npos) {
          p.uniform_(0.5, 1.5, gen);
        } else if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
          p.uniform_(-0.1, 0.1, gen);
        } else {
          p.normal_(0.0, 0.02, gen);
        }
      }};
}

std::shared_ptr<torch::nn::Module> deferred_transformer() {
  auto m = make_model(Model::kTransformer, /*seed=*/99);  // values about to be dropped
  defer_parameters(*m);
  return m;
}

std::shared_ptr<torch::nn::Module> initialised_transformer(const DeferredInit& init) {
  auto m = make_model(Model::kTransformer, /*seed=*/5);
  init_parameters(*m, init);
  return m;
}

TEST(DeferredInit, SeedsDependOnSeedAndNameOnly) {
  EXPECT_EQ(param_seed(1, "h0.qkv.weight"), param_seed(1, "h0.qkv.weight"));
  EXPECT_NE(param_seed(1, "h0.qkv.weight"), param_seed(2, "h0.qkv.weight"));
  EXPECT_NE(param_seed(1, "h0.qkv.weight"), param_seed(1, "h1.qkv.weight"));
  const at::Tensor a = initial_value(test_init(), "h0.qkv.weight", {4, 3});
  EXPECT_TRUE(at::equal(a, initial_value(test_init(), "h0.qkv.weight", {4, 3})));
  EXPECT_FALSE(at::equal(a, initial_value(test_init(), "h1.qkv.weight", {4, 3})));
  EXPECT_THROW(initial_value(DeferredInit{}, "x", {1}), InvalidArgument);
}

TEST(DeferredInit, DeferredParametersHoldNoMemoryUntilInitialised) {
  auto m = deferred_transformer();
  auto& tf = static_cast<TinyTransformerImpl&>(*m);
  const at::Tensor handle = tf.blocks[0]->qkv->weight;
  for (const auto& p : m->parameters()) {
    EXPECT_TRUE(is_deferred(p));
    EXPECT_EQ(p.storage().nbytes(), 0u);
  }
  init_parameters(*m, test_init());
  // The same tensor objects (the module's typed handles) now hold the initial values, and
  // these do not depend on whether the model was deferred.
  EXPECT_TRUE(tf.blocks[0]->qkv->weight.is_same(handle));
  auto ref = initialised_transformer(test_init());
  auto want = ref->named_parameters();
  for (const auto& item : m->named_parameters()) {
    EXPECT_FALSE(is_deferred(item.value())) << item.key();
    EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key();
  }
}

// (world size, sharding, bf16 parameters)
class FsdpDeferredInit : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy, bool>> {
};

TEST_P(FsdpDeferredInit, ShardsHoldSingleDeviceInitialValuesBitForBit) {
  const int world = std::get<0>(GetParam());
  const ShardingStrategy sharding = std::get<1>(GetParam());
  const bool bf16 = std::get<2>(GetParam());
  at::set_num_threads(1);
  const auto ref = initialised_transformer(test_init());
  int64_t total = 0;
  for (const auto& p : ref->parameters()) total += p.numel();
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(deferred_transformer());
  const bool hybrid = sharding == ShardingStrategy::kHybridShard;
  run_with_groups(world, hybrid ? 2 : 0, [&](Communicator& comm, const HybridGroups& g) {
    const int r = comm.rank();
    FsdpOptions o;
    o.sharding = sharding;
    o.wrap_policy = blocks_and_nested_up();
    o.deferred_init = test_init();
    if (bf16) o.mixed_precision.param_dtype = at::kBFloat16;
    o.shard_group = g.shard_group;
    o.replicate_group = g.replicate_group;
    FullyShardedDataParallel fsdp(modules[r],
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    const int shard = sharding == ShardingStrategy::kNoShard ? 1 : hybrid ? 2 : world;
    // No rank allocated the whole model: sharded, the module's parameters hold no memory and
    // the shards hold about 1/shard of it.
    int64_t shard_elements = 0;
    for (const auto& s : fsdp.parameters()) shard_elements += s.numel();
    const int64_t units = 1 + 2 * 2;  // root, two blocks, each with its nested `up`
    DTRAIN_CHECK(shard_elements <= total / shard + units,
                 "rank {} holds {} shard elements of {} at shard size {}", r, shard_elements, total,
                 shard);
    if (shard > 1) {
      for (const auto& item : modules[r]->named_parameters()) {
        DTRAIN_CHECK(item.value().storage().nbytes() == 0, "rank {}: '{}' holds memory", r,
                     item.key());
      }
    }
    auto state = fsdp.full_state_dict();
    if (r != 0) return;
    auto want = ref->named_parameters();
    size_t checked = 0;
    for (const auto& [name, t] : state) {
      if (!want.contains(name)) continue;
      DTRAIN_CHECK(at::equal(t, want[name]), "'{}' differs from init_parameters' value", name);
      ++checked;
    }
    DTRAIN_CHECK(checked == want.size(), "{} of {} parameters compared", checked, want.size());
  });
}

std::string deferred_case_name(
    const ::testing::TestParamInfo<std::tuple<int, ShardingStrategy, bool>>& info) {
  static const char* const kNames[] = {"full", "grad_op", "no_shard", "hybrid"};
  return std::string(kNames[static_cast<int>(std::get<1>(info.param))]) + "_x" +
         std::to_string(std::get<0>(info.param)) + (std::get<2>(info.param) ? "_bf16" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Sharding, FsdpDeferredInit,
    ::testing::Values(std::make_tuple(1, ShardingStrategy::kFullShard, false),
                      std::make_tuple(2, ShardingStrategy::kFullShard, false),
                      std::make_tuple(3, ShardingStrategy::kFullShard, false),
                      std::make_tuple(4, ShardingStrategy::kFullShard, false),
                      std::make_tuple(3, ShardingStrategy::kShardGradOp, false),
                      std::make_tuple(2, ShardingStrategy::kNoShard, false),
                      std::make_tuple(4, ShardingStrategy::kHybridShard, false),
                      std::make_tuple(2, ShardingStrategy::kFullShard, true),
                      std::make_tuple(1, ShardingStrategy::kFullShard, true)),
    deferred_case_name);

// After deferred initialisation FSDP trains as from a built model: the released gathered
// buffers are refilled at the first gather.
TEST(FsdpDeferredInitTraining, TrainsLikeSingleDeviceFromTheSameInitialValues) {
  at::set_num_threads(1);
  const int world = 2;
  Case c;
  c.model = Model::kTransformer;
  const auto data = make_data(c.model, world);
  auto ref = initialised_transformer(test_init());
  {
    SingleDevice single(ref);
    train(c, single, *ref, data, 0, kLocalBatch * world, nullptr);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(deferred_transformer());
  run_with_groups(world, 0, [&](Communicator& comm, const HybridGroups&) {
    const int r = comm.rank();
    FsdpOptions o;
    o.wrap_policy = blocks_and_nested_up();
    o.deferred_init = test_init();
    FullyShardedDataParallel fsdp(modules[r],
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    train(c, fsdp, *modules[r], data, r * kLocalBatch, kLocalBatch, &fsdp);
    auto state = fsdp.full_state_dict();
    if (r == 0) expect_state_matches(state, *ref, 1e-5, 1e-6);
  });
}

// A deferred model given to FSDP without deferred_init is refused, not read.
TEST(FsdpDeferredInitErrors, DeferredParametersNeedDeferredInit) {
  auto m = deferred_transformer();
  run_with_groups(1, 0, [&](Communicator& comm, const HybridGroups&) {
    try {
      FullyShardedDataParallel fsdp(m, std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
                                    FsdpOptions{});
      DTRAIN_CHECK(false, "a deferred model was accepted");
    } catch (const InvalidArgument& e) {
      DTRAIN_CHECK(std::string(e.what()).find("is deferred") != std::string::npos, "{}", e.what());
    }
  });
}

}  // namespace
}  // namespace dtrain

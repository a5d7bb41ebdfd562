// FullyShardedDataParallel against the reference: N ranks (threads, Gloo over loopback)
// training on their slices of the global batch must reach the parameters SingleDevice
// reaches on the whole batch, for every sharding strategy and prefetch policy.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "amp/bf16_check.h"
#include "compat/warnings.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/inspect.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

struct FsdpCase {
  std::string name;
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  BackwardPrefetch prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  bool nested = true;
  Opt opt = Opt::kSgd;
  double clip = 0;
  bool accumulate = false;  // two micro-batches per step, the first under no_sync()
  c10::optional<c10::ScalarType> param_dtype;
  Quantization quantize_params = Quantization::kNone;
  double rtol = 1e-5, atol = 1e-6;
};
void PrintTo(const FsdpCase& c, std::ostream* os) { *os << c.name; }

class FsdpEquivalence : public ::testing::TestWithParam<std::tuple<int, FsdpCase>> {};

TEST_P(FsdpEquivalence, MatchesSingleDeviceOnTheGlobalBatch) {
  const int world = std::get<0>(GetParam());
  const FsdpCase fc = std::get<1>(GetParam());
  at::set_num_threads(1);
  Case c;
  c.model = Model::kTransformer;
  c.opt = fc.opt;
  c.clip = fc.clip;
  c.accumulate = fc.accumulate;
  const auto data = make_data(c.model, world);
  auto ref = single_device_reference(c, data, world);  // one big batch
  auto modules = rank_models(c.model, world);
  const bool hybrid = fc.sharding == ShardingStrategy::kHybridShard;
  run_with_groups(world, hybrid ? world / 2 : 0, [&](Communicator& comm, const HybridGroups& g) {
    const int r = comm.rank();
    FsdpOptions o;
    o.sharding = fc.sharding;
    o.backward_prefetch = fc.prefetch;
    o.forward_prefetch = fc.forward_prefetch;
    o.wrap_policy = fc.nested ? blocks_and_nested_up() : wrap_modules_named("BlockImpl");
    o.mixed_precision.param_dtype = fc.param_dtype;
    o.quantize_params = fc.quantize_params;
    o.quantization_block = 64;
    o.shard_group = g.shard_group;
    o.replicate_group = g.replicate_group;
    FullyShardedDataParallel fsdp(modules[r],
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    train(c, fsdp, *modules[r], data, r * kLocalBatch, kLocalBatch, &fsdp);
    auto state = fsdp.full_state_dict();
    if (r == 0) {
      expect_state_matches(state, *ref, fc.rtol, fc.atol);
    } else {
      DTRAIN_CHECK(state.empty(), "full_state_dict is for rank 0 only");
    }
  });
}

std::vector<FsdpCase> fsdp_cases() {
  auto make = [](std::string name, const std::function<void(FsdpCase&)>& set) {
    FsdpCase c;
    c.name = std::move(name);
    set(c);
    return c;
  };
  return {
      make("full_shard_prefetch_pre", [](FsdpCase&) {}),
      make("full_shard_prefetch_post",
           [](FsdpCase& c) { c.prefetch = BackwardPrefetch::kBackwardPost; }),
      make("full_shard_no_prefetch_forward_prefetch",
           [](FsdpCase& c) {
             c.prefetch = BackwardPrefetch::kNone;
             c.forward_prefetch = true;
           }),
      make("full_shard_flat_units", [](FsdpCase& c) { c.nested = false; }),
      make("shard_grad_op", [](FsdpCase& c) { c.sharding = ShardingStrategy::kShardGradOp; }),
      make("no_shard", [](FsdpCase& c) { c.sharding = ShardingStrategy::kNoShard; }),
      // Gradient accumulation: the unsharded sum over micro-batches, reduced once.
      make("full_shard_accumulation", [](FsdpCase& c) { c.accumulate = true; }),
      make("no_shard_accumulation",
           [](FsdpCase& c) {
             c.sharding = ShardingStrategy::kNoShard;
             c.accumulate = true;
           }),
      // Adam divides by sqrt(v): round-off is amplified, hence 1e-4 (see training.h's eps).
      make("full_shard_adamw_clip",
           [](FsdpCase& c) {
             c.opt = Opt::kAdamW;
             c.clip = 0.5;
             c.rtol = 1e-4;
             c.atol = 1e-5;
           }),
  };
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpEquivalence,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::ValuesIn(fsdp_cases())),
                         [](const auto& info) {
                           return std::get<1>(info.param).name + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

FsdpCase hybrid_case() {
  FsdpCase c;
  c.name = "hybrid_2x2";
  c.sharding = ShardingStrategy::kHybridShard;
  return c;
}
FsdpCase hybrid_accumulation_case() {
  FsdpCase c = hybrid_case();
  c.name = "hybrid_2x2_accumulation";
  c.accumulate = true;
  return c;
}
INSTANTIATE_TEST_SUITE_P(Hybrid, FsdpEquivalence,
                         ::testing::Values(std::make_tuple(4, hybrid_case()),
                                           std::make_tuple(4, hybrid_accumulation_case())),
                         [](const auto& info) { return std::get<1>(info.param).name + "_world4"; });

FsdpCase bf16_case() {
  FsdpCase c;
  c.name = "bf16_params";
  c.param_dtype = at::kBFloat16;
  // bf16 keeps 8 significant bits: forward and gradients round at ~4e-3 relative. Measured
  // here: max |diff| 3.5e-3 against fp32 single-device training (worlds 1-4).
  c.rtol = 1e-2;
  c.atol = 1e-2;
  return c;
}
INSTANTIATE_TEST_SUITE_P(MixedPrecision, FsdpEquivalence,
                         ::testing::Values(std::make_tuple(2, bf16_case())),
                         [](const auto&) { return std::string("bf16_params_world2"); });

// Parameters gathered in int8 (blocks of 64) or bf16: the compute copy carries one
// quantisation of each parameter per gather, the fp32 shards stay exact.
FsdpCase quantized_params_case(Quantization q) {
  FsdpCase c;
  c.name = std::string(to_string(q)) + "_quantized_params";
  c.quantize_params = q;
  c.rtol = 1e-2;
  c.atol = 1e-2;
  return c;
}
INSTANTIATE_TEST_SUITE_P(
    QuantizedParams, FsdpEquivalence,
    ::testing::Values(std::make_tuple(2, quantized_params_case(Quantization::kInt8)),
                      std::make_tuple(4, quantized_params_case(Quantization::kInt8)),
                      std::make_tuple(2, quantized_params_case(Quantization::kBf16))),
    [](const auto& info) {
      return std::get<1>(info.param).name + "_world" + std::to_string(std::get<0>(info.param));
    });

// DataParallel's find_unused_parameters bug, checked for FSDP: a parameter used only in the
// no_sync micro-batch keeps its accumulated gradient through the synced step (the MLP as one
// root unit; its extra branch is used in the first micro-batch only).
TEST(FsdpAccumulation, ParameterUsedOnlyInTheNoSyncMicroBatchKeepsItsGradient) {
  at::set_num_threads(1);
  for (const bool set_to_none : {true, false}) {
    for (const int world : {1, 2, 3}) {
      Case c;
      c.model = Model::kMlp;
      c.accumulate = true;
      c.extra_in_first_micro_batch_only = true;
      c.set_to_none = set_to_none;
      const auto data = make_data(c.model, world);
      auto ref = single_device_reference(c, data, world);
      auto modules = rank_models(c.model, world);
      run_ranks(world, [&](Communicator& comm) {
        const int r = comm.rank();
        FullyShardedDataParallel fsdp(modules[r],
                                      std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
        train(c, fsdp, *modules[r], data, r * kLocalBatch, kLocalBatch, &fsdp);
        auto state = fsdp.full_state_dict();
        if (r == 0) expect_state_matches(state, *ref, 1e-5, 1e-6);
      });
    }
  }
}

// The mistake every LibTorch user makes first: the optimizer over model->parameters(). Under
// FSDP those are freed between steps and get no gradient, so it would train nothing; the
// first training forward refuses it on every rank, naming the fix, and a loop with no
// optimizer at all (the other FSDP tests) goes on. `wrong`: the ranks that make the mistake.
void optimizer_over_module_parameters(int world, const std::vector<int>& wrong) {
  at::set_num_threads(1);
  const auto data = make_data(Model::kTransformer, world);
  auto modules = rank_models(Model::kTransformer, world);
  std::vector<std::string> errors(static_cast<size_t>(world));
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    FullyShardedDataParallel fsdp(modules[r],
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    const bool mistake = std::find(wrong.begin(), wrong.end(), r) != wrong.end();
    // The right optimizer is built over parameters() (which counts) only on the other ranks.
    std::vector<at::Tensor> params = mistake ? modules[r]->parameters() : fsdp.parameters();
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      if (!errors[static_cast<size_t>(r)].empty()) break;
      try {
        at::Tensor x = data[s].x.narrow(0, r * kLocalBatch, kLocalBatch);
        at::Tensor y = data[s].y.narrow(0, r * kLocalBatch, kLocalBatch);
        at::Tensor loss =
            fsdp.forward([&] { return loss_of(Model::kTransformer, *modules[r], x, y, false); });
        fsdp.backward(loss);
        fsdp.clip_grad_norm(1.0);  // FSDP's own use of the shards does not count
        opt.step();
      } catch (const Error& e) {
        DTRAIN_CHECK(s == 0, "rank {} threw at step {}, not the first: {}", r, s, e.what());
        errors[static_cast<size_t>(r)] = e.what();
      }
    }
  });
  for (int r = 0; r < world; ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    const bool mistake = std::find(wrong.begin(), wrong.end(), r) != wrong.end();
    DTRAIN_CHECK(!e.empty(), "rank {} trained on although rank(s) {} step nothing", r,
                 fmt::format("{}", fmt::join(wrong, ", ")));
    if (mistake) {
      DTRAIN_CHECK(e.find("model->parameters()") != std::string::npos &&
                       e.find("strategy->parameters()") != std::string::npos,
                   "rank {}: the message does not name the mistake and the fix: {}", r, e);
    } else {
      DTRAIN_CHECK(e.find(fmt::format("failed on rank {}", wrong.front())) != std::string::npos,
                   "rank {}: the message does not name the failing rank: {}", r, e);
    }
  }
}

// What a program asks before calling the module itself (generation on one rank): only FSDP
// says no, because its units gather their parameters inside forward() alone.
TEST(FsdpStrategyInterface, ModuleRunsOutsideForwardExceptUnderFsdp) {
  at::set_num_threads(1);
  auto model = make_model(Model::kTransformer, 7);
  SingleDevice single(model);
  EXPECT_TRUE(static_cast<Strategy&>(single).module_runs_outside_forward());
  run_ranks(2, [&](Communicator& comm) {
    auto mine = make_model(Model::kTransformer, 7);
    auto shared = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    {
      DataParallel ddp(mine, shared);
      DTRAIN_CHECK(static_cast<Strategy&>(ddp).module_runs_outside_forward(), "DataParallel");
    }
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("BlockImpl");
    FullyShardedDataParallel fsdp(make_model(Model::kTransformer, 7), shared, o);
    DTRAIN_CHECK(!static_cast<Strategy&>(fsdp).module_runs_outside_forward(), "FSDP");
  });
}

TEST(FsdpOptimizer, OverModuleParametersIsRefusedOnEveryRankAtTheFirstStep) {
  optimizer_over_module_parameters(1, {0});
  optimizer_over_module_parameters(2, {0, 1});
  optimizer_over_module_parameters(3, {1});
}

// One training step on `world` threads with `options`; returns rank 0's collective log.
std::vector<std::string> step_log(int world, FsdpOptions options) {
  at::set_num_threads(1);
  const auto data = make_data(Model::kTransformer, world);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(make_model(Model::kTransformer, 7));
  std::vector<std::string> log;
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    FullyShardedDataParallel fsdp(
        modules[r], std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), options);
    Case c;
    c.model = Model::kTransformer;
    train(c, fsdp, *modules[r], data, r * kLocalBatch, kLocalBatch, nullptr);
    if (r == 0) log = detail::Inspect::last_collective_log(fsdp);
  });
  return log;
}

size_t position(const std::vector<std::string>& log, const std::string& entry) {
  for (size_t i = 0; i < log.size(); ++i)
    if (log[i] == entry) return i;
  return std::string::npos;
}

size_t last_position(const std::vector<std::string>& log, const std::string& entry) {
  for (size_t i = log.size(); i-- > 0;)
    if (log[i] == entry) return i;
  return std::string::npos;
}

TEST(FsdpPrefetch, PoliciesOrderCollectivesAsSpecified) {
  FsdpOptions o;
  o.wrap_policy = wrap_modules_named("BlockImpl");
  // The model has blocks h0, h1: forward runs h0 then h1, backward h1 then h0.
  o.backward_prefetch = BackwardPrefetch::kBackwardPre;
  auto pre = step_log(2, o);
  // BACKWARD_PRE: h0 is gathered when h1's backward starts, before h1's gradient is reduced.
  EXPECT_LT(position(pre, "all_gather:h0 (prefetch)"), position(pre, "reduce_scatter:h1"))
      << fmt::format("{}", fmt::join(pre, ", "));

  o.backward_prefetch = BackwardPrefetch::kBackwardPost;
  auto post = step_log(2, o);
  // BACKWARD_POST: h0 is gathered right after h1's reduce-scatter is issued.
  const size_t rs = position(post, "reduce_scatter:h1");
  ASSERT_NE(rs, std::string::npos) << fmt::format("{}", fmt::join(post, ", "));
  EXPECT_EQ(position(post, "all_gather:h0 (prefetch)"), rs + 1)
      << fmt::format("{}", fmt::join(post, ", "));

  o.backward_prefetch = BackwardPrefetch::kNone;
  auto none = step_log(2, o);
  for (const auto& e : none) EXPECT_EQ(e.find("prefetch"), std::string::npos) << e;
  // Without prefetch h0's backward gather (its last gather of the step) comes after h1's
  // reduce-scatter, on demand.
  EXPECT_LT(position(none, "reduce_scatter:h1"), last_position(none, "all_gather:h0"))
      << fmt::format("{}", fmt::join(none, ", "));

  o.forward_prefetch = true;
  auto fwd = step_log(2, o);
  EXPECT_NE(position(fwd, "all_gather:h1 (prefetch)"), std::string::npos)
      << fmt::format("{}", fmt::join(fwd, ", "));
}

size_t count_prefix(const std::vector<std::string>& log, const std::string& prefix) {
  return static_cast<size_t>(std::count_if(
      log.begin(), log.end(), [&](const std::string& e) { return e.rfind(prefix, 0) == 0; }));
}

// Under no_sync() a backward issues no gradient collective and holds each unit's unsharded
// fp32 gradient; the synced backward reduces each unit exactly once.
TEST(FsdpAccumulation, OneReductionPerUnitPerOptimizerStep) {
  at::set_num_threads(1);
  const int world = 2;
  const auto data = make_data(Model::kTransformer, world);
  for (auto sharding : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    const std::string reduction =
        sharding == ShardingStrategy::kFullShard ? "reduce_scatter:" : "all_reduce:";
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    for (int r = 0; r < world; ++r) modules.push_back(make_model(Model::kTransformer, 7));
    run_ranks(world, [&](Communicator& comm) {
      const int r = comm.rank();
      FsdpOptions o;
      o.sharding = sharding;
      o.wrap_policy = wrap_modules_named("BlockImpl");
      FullyShardedDataParallel fsdp(modules[r],
                                    std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
      auto opt = make_opt(Opt::kSgd, fsdp.parameters());
      int64_t held_bytes = 0;  // the documented cost: 4 bytes per padded element of every unit
      for (const auto& [name, t] : fsdp.sharded_state_dict()) {
        if (name.size() > 10 && name.compare(name.size() - 10, 10, ".flat_meta") == 0) {
          held_bytes += 4 * t[3].item<int64_t>();
        }
      }
      for (int step = 0; step < 2; ++step) {
        // In place (1.13's zero_grad), so that the shards' .grad made by step 0 stays and the
        // model state before the step and after its synced backward are the same.
        zero_grad_in_place(*opt);
        at::Tensor x = data[step].x.narrow(0, r * kLocalBatch, kLocalBatch);
        at::Tensor y = data[step].y.narrow(0, r * kLocalBatch, kLocalBatch);
        auto micro = [&](int64_t from, int64_t n) {
          at::Tensor l = fsdp.forward([&] {
            return loss_of(Model::kTransformer, *modules[r], x.narrow(0, from, n),
                           y.narrow(0, from, n), false);
          });
          fsdp.backward(l);
        };
        const int64_t before = fsdp.model_state_bytes();
        {
          auto guard = fsdp.no_sync();
          DTRAIN_CHECK(!fsdp.requires_gradient_sync(), "no_sync() turns sync off");
          micro(0, 1);
        }
        DTRAIN_CHECK(fsdp.requires_gradient_sync(), "the guard restores sync");
        const auto held = detail::Inspect::last_collective_log(fsdp);
        DTRAIN_CHECK(count_prefix(held, "reduce_scatter:") + count_prefix(held, "all_reduce:") == 0,
                     "step {}: no_sync backward reduced: {}", step, fmt::join(held, ", "));
        DTRAIN_CHECK(fsdp.model_state_bytes() - before == held_bytes,
                     "step {}: held gradients take {} bytes, expected {}", step,
                     fsdp.model_state_bytes() - before, held_bytes);
        micro(1, kLocalBatch - 1);
        const auto synced = detail::Inspect::last_collective_log(fsdp);
        for (const std::string unit : {"(root)", "h0", "h1"}) {
          DTRAIN_CHECK(count_prefix(synced, reduction + unit) == 1,
                       "step {}: {} issued {} times: {}", step, reduction + unit,
                       count_prefix(synced, reduction + unit), fmt::join(synced, ", "));
        }
        DTRAIN_CHECK(count_prefix(synced, reduction) == 3, "step {}: {}", step,
                     fmt::join(synced, ", "));
        if (step > 0) {  // (step 0 created the shards' .grad)
          DTRAIN_CHECK(fsdp.model_state_bytes() == before, "step {}: the held gradient is freed",
                       step);
        }
        opt->step();
      }
    });
  }
}

// Over replicas (NO_SHARD, HYBRID_SHARD) a unit's all-reduce is issued while backward still
// runs, as DDP's buckets are: by the time the root's gradients are computed (a hook on wpe's
// weight, whose gradient comes after every block's backward), the last block's all-reduce
// was issued; the root's own comes after.
TEST(FsdpOverlap, ReplicaAllReducesAreIssuedDuringBackward) {
  at::set_num_threads(1);
  struct Setup {
    ShardingStrategy sharding;
    int world;
    std::vector<std::string> issued_by_then;
  };
  for (const Setup& setup :
       {Setup{ShardingStrategy::kNoShard, 2, {"all_reduce:h2", "all_reduce:h1"}},
        Setup{ShardingStrategy::kHybridShard, 4, {"all_reduce:h2"}}}) {
    const int world = setup.world;
    const bool hybrid = setup.sharding == ShardingStrategy::kHybridShard;
    const auto data = make_data(Model::kTransformer, world);
    std::vector<std::shared_ptr<TinyTransformerImpl>> modules;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(7);
      modules.push_back(TinyTransformer(50, 8, 16, 2, /*layers=*/3).ptr());
    }
    run_with_groups(world, hybrid ? 2 : 0, [&](Communicator& comm, const HybridGroups& g) {
      const int r = comm.rank();
      FsdpOptions o;
      o.sharding = setup.sharding;
      o.wrap_policy = wrap_modules_named("BlockImpl");
      o.shard_group = g.shard_group;
      o.replicate_group = g.replicate_group;
      FullyShardedDataParallel fsdp(modules[r],
                                    std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
      std::vector<std::string> during;
      modules[r]->wpe->weight.register_hook(
          [&](const at::Tensor&) { during = detail::Inspect::last_collective_log(fsdp); });
      auto opt = make_opt(Opt::kSgd, fsdp.parameters());
      for (int step = 0; step < 2; ++step) {
        opt->zero_grad();
        at::Tensor x = data[step].x.narrow(0, r * kLocalBatch, kLocalBatch);
        at::Tensor y = data[step].y.narrow(0, r * kLocalBatch, kLocalBatch);
        fsdp.backward(
            fsdp.forward([&] { return loss_of(Model::kTransformer, *modules[r], x, y, false); }));
        opt->step();
        const auto after = detail::Inspect::last_collective_log(fsdp);
        for (const auto& entry : setup.issued_by_then) {
          DTRAIN_CHECK(position(during, entry) != std::string::npos,
                       "rank {} step {}: {} not issued during backward; by the root's backward: {}",
                       r, step, entry, fmt::join(during, ", "));
        }
        DTRAIN_CHECK(position(during, "all_reduce:(root)") == std::string::npos,
                     "rank {}: the root's gradient cannot be reduced before it is computed", r);
        for (const std::string unit : {"(root)", "h0", "h1", "h2"}) {
          DTRAIN_CHECK(count_prefix(after, "all_reduce:" + unit) == 1, "rank {}: {}", r,
                       fmt::join(after, ", "));
        }
      }
    });
  }
}

// An MLP whose output is scaled by a buffer (as a normalisation's statistics would).
struct ScaledMlpImpl : torch::nn::Module {
  ScaledMlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))),
        scale(register_buffer("scale", at::full({4}, 1.0 / 3.0))),
        count(register_buffer("count", at::zeros({1}, at::kLong))) {}
  at::Tensor forward(const at::Tensor& x) {
    seen_dtype = scale.scalar_type();
    return fc2->forward(at::tanh(fc1->forward(x))) * scale;
  }
  torch::nn::Linear fc1, fc2;
  at::Tensor scale, count;
  c10::ScalarType seen_dtype = at::kFloat;
};
TORCH_MODULE(ScaledMlp);

// MixedPrecision::buffer_dtype: the module computes with bf16 buffers (integer ones stay),
// training matches single-device training with the buffer rounded to bf16, and state dicts
// and checkpoints see the buffers in their original dtype.
TEST(FsdpMixedPrecision, BufferDtypeCastsFloatingBuffersForTraining) {
  at::set_num_threads(1);
  const int world = 2;
  torch::manual_seed(1234);
  std::vector<Batch> data;
  for (int s = 0; s < kSteps; ++s)
    data.push_back({at::randn({3 * world, 6}), at::randn({3 * world, 4})});
  auto run = [&](Strategy& s, ScaledMlpImpl& m, int64_t row0, int64_t rows) {
    auto opt = make_opt(Opt::kSgd, s.parameters());
    for (int step = 0; step < kSteps; ++step) {
      opt->zero_grad();
      at::Tensor x = data[step].x.narrow(0, row0, rows), y = data[step].y.narrow(0, row0, rows);
      s.backward(s.forward([&] { return at::mse_loss(m.forward(x), y); }));
      opt->step();
    }
  };
  torch::manual_seed(7);
  auto ref = ScaledMlp();
  ref->scale.copy_(ref->scale.to(at::kBFloat16).to(at::kFloat));  // what bf16 keeps of 1/3
  SingleDevice single(ref.ptr());
  run(single, *ref, 0, 3 * world);

  std::vector<ScaledMlp> modules;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(7);
    modules.push_back(ScaledMlp());
  }
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    FsdpOptions o;
    o.mixed_precision.buffer_dtype = at::kBFloat16;
    FullyShardedDataParallel fsdp(modules[r].ptr(),
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    DTRAIN_CHECK(modules[r]->count.scalar_type() == at::kLong, "integer buffers are not cast");
    run(fsdp, *modules[r], r * 3, 3);
    DTRAIN_CHECK(modules[r]->seen_dtype == at::kBFloat16, "forward saw a {} buffer",
                 c10::toString(modules[r]->seen_dtype));
    auto state = fsdp.full_state_dict();
    if (r == 0) {
      expect_state_matches(state, *ref, 1e-5, 1e-6);
      for (const auto& [name, t] : state) {
        if (name != "scale") continue;
        DTRAIN_CHECK(t.scalar_type() == at::kFloat, "full_state_dict's buffer is {}",
                     c10::toString(t.scalar_type()));
        DTRAIN_CHECK(at::equal(t, ref->scale), "buffer values");
      }
    }
    // Checkpoints: the original dtype, and what is loaded into the slice reaches the module.
    StateLayout layout = fsdp.state_layout();
    bool found = false;
    for (auto& s : layout.slices) {
      if (s.name != "scale") continue;
      found = true;
      DTRAIN_CHECK(s.dtype == at::kFloat && s.data.scalar_type() == at::kFloat,
                   "checkpoint slice is {}", c10::toString(s.data.scalar_type()));
      s.data.fill_(0.5);
    }
    DTRAIN_CHECK(found, "no slice for the buffer");
    fsdp.state_loaded();
    DTRAIN_CHECK(modules[r]->scale.scalar_type() == at::kBFloat16 &&
                     modules[r]->scale.eq(0.5).all().item<bool>(),
                 "state_loaded() writes the loaded buffer back");
  });
}

// bf16 param_dtype on a CPU without native bf16: it trains, and rank 0 alone warns once,
// through LibTorch's warning channel (c10's handler is per thread: each rank counts its own).
TEST(FsdpMixedPrecision, EmulatedBf16WarnsOnceOnRankZero) {
  const int world = 2;
  CpuFeatures avx2;
  avx2.arch = "x86_64";
  avx2.sse3 = avx2.ssse3 = avx2.sse4_2 = avx2.avx = avx2.avx2 = avx2.fma = true;
  CpuFeatures native = avx2;
  native.amx_bf16 = true;
  std::vector<ScaledMlp> modules;
  for (int r = 0; r < 2 * world; ++r) {
    torch::manual_seed(7);
    modules.push_back(ScaledMlp());
  }
  std::vector<size_t> emulated(world), with_native(world);
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    auto count = [&](const CpuFeatures& cpu, ScaledMlp& m) {
      compat::WarningCapture warnings;
      FsdpOptions o;
      o.mixed_precision.param_dtype = at::kBFloat16;
      detail::Bf16CpuInjection::set_cpu(o.mixed_precision.cpu_check, cpu);
      FullyShardedDataParallel fsdp(m.ptr(),
                                    std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
      at::Tensor loss = fsdp.forward([&] {
        return m->forward(at::ones({2, 6}, at::kBFloat16)).to(at::kFloat).sum();
      });
      fsdp.backward(loss);
      size_t n = 0;
      for (const auto& msg : warnings.messages()) {
        n += msg.find("dtrain FullyShardedDataParallel: bf16 is emulated") != std::string::npos;
      }
      return n;
    };
    emulated[r] = count(avx2, modules[r]);
    with_native[r] = count(native, modules[world + r]);
  });
  EXPECT_EQ(emulated[0], 1u);
  EXPECT_EQ(emulated[1], 0u);
  EXPECT_EQ(with_native[0], 0u);
  EXPECT_EQ(with_native[1], 0u);
}

TEST(FsdpMemory, ModelStateIsAboutOneNthOfDataParallel) {
  at::set_num_threads(1);
  const int world = 4;
  const auto data = make_data(Model::kTransformer, world);
  std::vector<std::shared_ptr<torch::nn::Module>> ddp_modules, fsdp_modules;
  for (int r = 0; r < world; ++r) {
    ddp_modules.push_back(make_model(Model::kTransformer, 7));
    fsdp_modules.push_back(make_model(Model::kTransformer, 7));
  }
  std::vector<int64_t> ddp_bytes(world), fsdp_bytes(world), fsdp_init(world), ddp_init(world);
  auto adam_state = [](torch::optim::Optimizer& opt) {
    std::vector<at::Tensor> out;
    for (auto& kv : opt.state()) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*kv.second);
      out.push_back(s.exp_avg());
      out.push_back(s.exp_avg_sq());
    }
    return out;
  };
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    auto borrowed = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    Case c;
    c.model = Model::kTransformer;
    c.opt = Opt::kAdamW;
    DataParallel ddp(ddp_modules[r], borrowed);
    ddp_init[r] = ddp.model_state_bytes();
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("BlockImpl");
    FullyShardedDataParallel fsdp(fsdp_modules[r], borrowed, o);
    fsdp_init[r] = fsdp.model_state_bytes();
    // Train both, then measure between steps with the optimizer state included.
    for (int which = 0; which < 2; ++which) {
      Strategy& s = which == 0 ? static_cast<Strategy&>(ddp) : static_cast<Strategy&>(fsdp);
      auto& m = which == 0 ? *ddp_modules[r] : *fsdp_modules[r];
      auto opt = make_opt(Opt::kAdamW, s.parameters());
      for (int step = 0; step < 2; ++step) {
        opt->zero_grad();
        at::Tensor x = data[step].x.narrow(0, r * kLocalBatch, kLocalBatch);
        at::Tensor y = data[step].y.narrow(0, r * kLocalBatch, kLocalBatch);
        at::Tensor l = s.forward([&] { return loss_of(c.model, m, x, y, false); });
        s.backward(l);
        opt->step();
      }
      (which == 0 ? ddp_bytes : fsdp_bytes)[r] = s.model_state_bytes(adam_state(*opt));
    }
  });
  for (int r = 0; r < world; ++r) {
    const double ratio = double(fsdp_bytes[r]) / double(ddp_bytes[r]);
    // Shards are 1/4 of every unit's flat buffer, plus at most world-1 padding elements
    // per unit: the ratio must be close to 1/4.
    EXPECT_LT(ratio, 0.25 * 1.05) << "rank " << r << ": fsdp " << fsdp_bytes[r] << " B, ddp "
                                  << ddp_bytes[r] << " B";
    EXPECT_GT(ratio, 0.25 * 0.95) << "rank " << r;
    EXPECT_LT(double(fsdp_init[r]) / double(ddp_init[r]), 0.25 * 1.05 + 0.01) << "rank " << r;
  }
}

TEST(FsdpErrors, UnitNeverCalledThroughUnitCallIsReported) {
  at::set_num_threads(1);
  auto model = Mlp(6, 16, 4);
  FsdpOptions o;
  o.wrap_policy = [](const std::string& name, const torch::nn::Module&) { return name == "fc2"; };
  run_ranks(1, [&](Communicator& comm) {
    FullyShardedDataParallel fsdp(model.ptr(),
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    try {
      fsdp.forward([&] { return model->forward(at::randn({2, 6})).sum(); });
      DTRAIN_CHECK(false, "expected an error for a unit never run through unit_call");
    } catch (const InvalidArgument& e) {
      DTRAIN_CHECK(std::string(e.what()).find("'fc2'") != std::string::npos, "{}", e.what());
    }
  });
}

// sharded_state_dict() is a snapshot FSDP loads back (load_sharded_state_dict): training on
// from it ends where the snapshot's run ended; a snapshot of another layout, a missing, extra
// or altered entry is refused naming the entry, and loads nothing.
TEST(FsdpShardedStateDict, LoadsWhatItSavedAndRefusesAnotherLayout) {
  at::set_num_threads(1);
  constexpr int kWorld = 2;
  const auto data = make_data(Model::kTransformer, kWorld);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < kWorld; ++r) modules.push_back(make_model(Model::kTransformer, 7));
  run_ranks(kWorld, [&](Communicator& comm) {
    const int r = comm.rank();
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("BlockImpl");
    FullyShardedDataParallel fsdp(modules[r],
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    auto opt = make_opt(Opt::kSgd, fsdp.parameters());
    auto step = [&](int s) {
      opt->zero_grad();
      at::Tensor x = data[s].x.narrow(0, r * kLocalBatch, kLocalBatch);
      at::Tensor y = data[s].y.narrow(0, r * kLocalBatch, kLocalBatch);
      fsdp.backward(
          fsdp.forward([&] { return loss_of(Model::kTransformer, *modules[r], x, y, false); }));
      opt->step();
    };
    step(0);
    const auto snapshot = fsdp.sharded_state_dict();
    const auto at_snapshot = fsdp.full_state_dict();
    step(1);
    const auto later = fsdp.full_state_dict();
    auto refused = [&](std::vector<std::pair<std::string, at::Tensor>> state) {
      try {
        fsdp.load_sharded_state_dict(state);
      } catch (const InvalidArgument& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    auto extra = snapshot;
    extra.emplace_back("h9.flat_shard", at::zeros({3}));
    auto missing = snapshot;
    missing.pop_back();
    auto altered = snapshot;
    for (auto& [name, t] : altered) {
      if (name.find(".flat_meta") != std::string::npos) t = t.clone().add_(1);
    }
    DTRAIN_CHECK(refused(extra).find("entry 'h9.flat_shard' is not one of") != std::string::npos,
                 "rank {}: an extra entry: '{}'", r, refused(extra));
    DTRAIN_CHECK(refused(missing).find("is missing") != std::string::npos,
                 "rank {}: a missing entry: '{}'", r, refused(missing));
    DTRAIN_CHECK(refused(altered).find("differs from this rank's layout") != std::string::npos,
                 "rank {}: altered metadata: '{}'", r, refused(altered));
    // Nothing was loaded by the refused calls: the state is still the later one.
    const auto unchanged = fsdp.full_state_dict();
    for (size_t i = 0; i < unchanged.size(); ++i) {
      DTRAIN_CHECK(at::equal(unchanged[i].second, later[i].second), "rank {}: {} changed", r,
                   unchanged[i].first);
    }
    fsdp.load_sharded_state_dict(snapshot);
    const auto loaded = fsdp.full_state_dict();
    DTRAIN_CHECK(loaded.size() == at_snapshot.size(), "rank {}: {} entries", r, loaded.size());
    bool moved = false;
    for (size_t i = 0; i < loaded.size(); ++i) {
      DTRAIN_CHECK(at::equal(loaded[i].second, at_snapshot[i].second), "rank {}: {} not restored",
                   r, loaded[i].first);
      moved = moved || !at::equal(later[i].second, at_snapshot[i].second);
    }
    DTRAIN_CHECK(r != 0 || moved, "the second step changed nothing: the test proves nothing");
    step(1);  // trains on from the snapshot
    fsdp.finish();
  });
}

}  // namespace
}  // namespace dtrain

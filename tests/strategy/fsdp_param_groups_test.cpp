// Optimizer parameter groups under every strategy (issue 14). With FSDP's per-parameter
// shard views (FsdpOptions::use_orig_params), AdamW's usual groups -- weight decay on the
// matrices, none on biases, LayerNorm and embeddings -- exempt the same parameters under
// SingleDevice, DataParallel and FSDP; training then matches single-device training on the
// global batch, and the optimizer state kept per view survives a checkpoint loaded on
// another world size.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

constexpr double kLr = 1e-2;
// Large, so that decaying a parameter that should not be (or the reverse) moves it far
// beyond the comparison's tolerance within a few steps.
constexpr double kDecay = 0.5;

// GPT-2's groups: matrices decay; biases, LayerNorm weights and the embeddings do not.
// Decided by name and full shape: under FSDP the tensor is 1-D, a part of the parameter.
bool decays(const NamedParameter& p) {
  return p.shape.size() >= 2 && p.name != "wte.weight" && p.name != "wpe.weight";
}

std::unique_ptr<torch::optim::AdamW> grouped_adamw(Strategy& s, double lr = kLr) {
  std::vector<at::Tensor> decay, exempt;
  for (const auto& p : s.named_parameters()) (decays(p) ? decay : exempt).push_back(p.tensor);
  // eps well above round-off, as in training.h's make_opt.
  auto options = [&](double wd) {
    return torch::optim::AdamWOptions(lr).eps(1e-4).weight_decay(wd);
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay);
  groups.emplace_back(exempt, std::make_unique<torch::optim::AdamWOptions>(options(0)));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), options(kDecay));
}

struct GroupCase {
  std::string name;
  bool ddp = false;  // else FSDP with use_orig_params
  int world = 2;
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  c10::optional<c10::ScalarType> param_dtype;
  bool accumulate = false;   // two micro-batches per step, the first without gradient sync
  bool set_to_none = false;  // .grad reset to undefined between steps (LibTorch 2.x zero_grad)
  double clip = 0;
  double rtol = 1e-4, atol = 1e-5;  // Adam amplifies round-off (see training.h)
};
void PrintTo(const GroupCase& c, std::ostream* os) { *os << c.name; }

// Steps [first, last) on rows [row0, row0 + rows) of each global batch. `split`: the step
// is two micro-batches, the first without gradient sync.
void train_steps(Strategy& s, torch::nn::Module& m, torch::optim::Optimizer& opt,
                 const std::vector<Batch>& data, int first, int last, int64_t row0, int64_t rows,
                 const GroupCase& c, bool split) {
  for (int step = first; step < last; ++step) {
    if (c.set_to_none) {
      for (auto& p : s.parameters()) p.mutable_grad().reset();
    } else {
      opt.zero_grad();  // 1.13: detach_() and zero_() each .grad in place
    }
    const at::Tensor x = data[step].x.narrow(0, row0, rows);
    const at::Tensor y = data[step].y.narrow(0, row0, rows);
    const int64_t parts = split ? 2 : 1;
    for (int64_t k = 0; k < parts; ++k) {
      const int64_t b = rows * k / parts, e = rows * (k + 1) / parts;
      s.set_requires_gradient_sync(k + 1 == parts);
      at::Tensor l = s.forward([&] {
        return loss_of(Model::kTransformer, m, x.narrow(0, b, e - b), y.narrow(0, b, e - b), true);
      });
      s.backward(l * (double(e - b) / rows));
    }
    if (c.clip > 0) s.clip_grad_norm(c.clip);
    opt.step();
  }
}

FsdpOptions fsdp_options(const GroupCase& c, const HybridGroups& g) {
  FsdpOptions o;
  o.use_orig_params = true;
  o.sharding = c.sharding;
  o.wrap_policy = blocks_and_nested_up();  // more units, more shard boundaries
  o.mixed_precision.param_dtype = c.param_dtype;
  o.shard_group = g.shard_group;
  o.replicate_group = g.replicate_group;
  return o;
}

CommunicatorPtr borrowed(Communicator& comm) {
  return std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
}

class ParamGroups : public ::testing::TestWithParam<GroupCase> {};

TEST_P(ParamGroups, DecayOnMatricesOnlyMatchesSingleDevice) {
  const GroupCase c = GetParam();
  at::set_num_threads(1);
  const auto data = make_data(Model::kTransformer, c.world);
  auto ref = make_model(Model::kTransformer, 7);
  SingleDevice single(ref);
  const std::vector<NamedParameter> want = single.named_parameters();
  auto ref_opt = grouped_adamw(single);
  ASSERT_EQ(ref_opt->param_groups().size(), 2u);
  ASSERT_GT(ref_opt->param_groups()[0].params().size(), 0u);
  ASSERT_GT(ref_opt->param_groups()[1].params().size(), 0u);
  train_steps(single, *ref, *ref_opt, data, 0, kSteps, 0, kLocalBatch * c.world, c, false);

  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < c.world; ++r) {
    modules.push_back(make_model(Model::kTransformer, r == 0 ? 7 : 100 + r));
  }
  std::mutex mu;
  std::map<int, std::map<std::string, int64_t>> held;  // rank -> parameter -> elements held
  const bool hybrid = c.sharding == ShardingStrategy::kHybridShard;
  run_with_groups(c.world, hybrid ? 2 : 0, [&](Communicator& comm, const HybridGroups& g) {
    const int r = comm.rank();
    std::unique_ptr<Strategy> s;
    if (c.ddp) {
      s = std::make_unique<DataParallel>(modules[r], borrowed(comm));
    } else {
      s = std::make_unique<FullyShardedDataParallel>(modules[r], borrowed(comm),
                                                     fsdp_options(c, g));
    }
    const std::vector<NamedParameter> got = s->named_parameters();
    DTRAIN_CHECK(got.size() == want.size(), "rank {}: {} named parameters, single has {}", r,
                 got.size(), want.size());
    const std::vector<at::Tensor> stepped = s->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      DTRAIN_CHECK(got[i].name == want[i].name && got[i].shape == want[i].shape,
                   "rank {}: parameter {} is {}, single's is {}", r, i, got[i].name, want[i].name);
      DTRAIN_CHECK(got[i].tensor.is_same(stepped[i]), "rank {}: {} is not parameters()[{}]", r,
                   got[i].name, i);
      std::lock_guard<std::mutex> lock(mu);
      held[r][got[i].name] = got[i].tensor.numel();
    }
    auto opt = grouped_adamw(*s);
    train_steps(*s, *modules[r], *opt, data, 0, kSteps, r * kLocalBatch, kLocalBatch, c,
                c.accumulate);
    if (c.ddp) {
      expect_same_parameters(*ref, *modules[r], r, c.rtol, c.atol);
      return;
    }
    auto state = static_cast<FullyShardedDataParallel&>(*s).full_state_dict();
    if (r == 0) expect_state_matches(state, *ref, c.rtol, c.atol);
  });

  if (c.ddp || (c.sharding != ShardingStrategy::kFullShard &&
                c.sharding != ShardingStrategy::kShardGradOp)) {
    return;
  }
  // Sharded over every rank: the views tile each parameter exactly once.
  bool split = false, none = false;
  for (const auto& p : want) {
    int64_t total = 0;
    for (int r = 0; r < c.world; ++r) {
      const int64_t n = held[r][p.name];
      total += n;
      split = split || (n > 0 && n < p.tensor.numel());
      none = none || n == 0;
    }
    EXPECT_EQ(total, p.tensor.numel()) << p.name;
  }
  // The layouts these cases are chosen for: a shard boundary inside a parameter, and a rank
  // holding none of some parameter (an empty view in its optimizer).
  EXPECT_TRUE(split);
  EXPECT_TRUE(none);
}

std::vector<GroupCase> group_cases() {
  auto make = [](std::string name, const std::function<void(GroupCase&)>& set) {
    GroupCase c;
    c.name = std::move(name);
    set(c);
    return c;
  };
  return {
      make("ddp_world2", [](GroupCase& c) { c.ddp = true; }),
      make("fsdp_full_shard_world2", [](GroupCase&) {}),
      make("fsdp_full_shard_world3", [](GroupCase& c) { c.world = 3; }),
      make("fsdp_shard_grad_op_world3_accumulation_set_to_none_clip",
           [](GroupCase& c) {
             c.world = 3;
             c.sharding = ShardingStrategy::kShardGradOp;
             c.accumulate = true;
             c.set_to_none = true;
             c.clip = 0.5;
           }),
      make("fsdp_no_shard_world2", [](GroupCase& c) { c.sharding = ShardingStrategy::kNoShard; }),
      make("fsdp_hybrid_2x2",
           [](GroupCase& c) {
             c.world = 4;
             c.sharding = ShardingStrategy::kHybridShard;
           }),
      // bf16 compute, fp32 master shards and views. AdamW moves an element by about lr per
      // step whatever its gradient's size, so bf16's rounding of small gradients shows at
      // full step size: measured max |diff| 0.024 after the steps here (so wider than
      // FsdpEquivalence's SGD bound).
      make("fsdp_bf16_world2",
           [](GroupCase& c) {
             c.param_dtype = at::kBFloat16;
             c.rtol = 5e-2;
             c.atol = 2e-2;
           }),
  };
}

INSTANTIATE_TEST_SUITE_P(Strategies, ParamGroups, ::testing::ValuesIn(group_cases()),
                         [](const auto& info) { return info.param.name; });

// One step with zero gradients: AdamW then moves a parameter only by its weight decay, so a
// parameter changes exactly when its group decays it. The exempt ones must come out
// bit-identical under every strategy, the others scaled by 1 - lr x decay.
TEST(ParamGroups, DecayExemptsBiasesLayerNormAndEmbeddingsUnderEveryStrategy) {
  at::set_num_threads(1);
  constexpr double kStepLr = 0.1;
  const auto data = make_data(Model::kTransformer, 3);
  auto initial = make_model(Model::kTransformer, 7);
  auto check = [&](const std::string& who,
                   const std::vector<std::pair<std::string, at::Tensor>>& after) {
    auto before = initial->named_parameters();
    std::vector<std::string> exempt;
    for (const auto& [name, t] : after) {
      const at::Tensor& p0 = before[name];
      if (t.dim() >= 2 && name != "wte.weight" && name != "wpe.weight") {
        DTRAIN_CHECK(at::allclose(t, p0 * (1 - kStepLr * kDecay), 1e-6, 0), "{}: {} not decayed",
                     who, name);
      } else {
        DTRAIN_CHECK(at::equal(t, p0), "{}: {} changed: it must be exempt from weight decay", who,
                     name);
        exempt.push_back(name);
      }
    }
    DTRAIN_CHECK(after.size() == before.size(), "{}: {} parameters", who, after.size());
    for (const char* name : {"wte.weight", "wpe.weight", "h0.qkv.bias", "h1.ln1.weight"}) {
      DTRAIN_CHECK(std::find(exempt.begin(), exempt.end(), name) != exempt.end(),
                   "{}: {} is not among the exempt parameters", who, name);
    }
  };
  auto zero_gradient_step = [&](Strategy& s, torch::nn::Module& m, int64_t row0, int64_t rows) {
    auto opt = grouped_adamw(s, kStepLr);
    opt->zero_grad();
    at::Tensor l = s.forward([&] {
      return loss_of(Model::kTransformer, m, data[0].x.narrow(0, row0, rows),
                     data[0].y.narrow(0, row0, rows), true);
    });
    s.backward(l * 0);
    opt->step();
  };
  auto named = [](const torch::nn::Module& m) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
    return out;
  };

  auto single_model = make_model(Model::kTransformer, 7);
  SingleDevice single(single_model);
  zero_gradient_step(single, *single_model, 0, 3 * kLocalBatch);
  check("single", named(*single_model));

  for (int world : {2, 3}) {
    for (const bool ddp : {true, false}) {
      if (ddp && world == 3) continue;
      std::vector<std::shared_ptr<torch::nn::Module>> modules;
      for (int r = 0; r < world; ++r) modules.push_back(make_model(Model::kTransformer, 7));
      run_ranks(world, [&](Communicator& comm) {
        const int r = comm.rank();
        const std::string who = fmt::format("{} x{} rank {}", ddp ? "ddp" : "fsdp", world, r);
        if (ddp) {
          DataParallel s(modules[r], borrowed(comm));
          zero_gradient_step(s, *modules[r], r * kLocalBatch, kLocalBatch);
          check(who, named(*modules[r]));
          return;
        }
        GroupCase c;
        FullyShardedDataParallel s(modules[r], borrowed(comm), fsdp_options(c, HybridGroups{}));
        zero_gradient_step(s, *modules[r], r * kLocalBatch, kLocalBatch);
        auto state = s.full_state_dict();
        if (r == 0) check(who, state);
      });
    }
  }
}

TEST(ParamGroups, FsdpNamesParametersOnlyWithUseOrigParams) {
  auto model = make_model(Model::kTransformer, 7);
  run_ranks(1, [&](Communicator& comm) {
    FsdpOptions o;
    o.use_orig_params = false;  // the flat shards (the default since the step driver: views)
    o.wrap_policy = wrap_modules_named("BlockImpl");
    FullyShardedDataParallel s(model, borrowed(comm), o);
    try {
      s.named_parameters();
      DTRAIN_CHECK(false, "named_parameters() without use_orig_params must throw");
    } catch (const InvalidArgument& e) {
      DTRAIN_CHECK(std::string(e.what()).find("use_orig_params") != std::string::npos, "{}",
                   e.what());
    }
    DTRAIN_CHECK(s.parameters().size() == 3, "one flat shard per unit (root, h0, h1)");
  });
}

// parameters() and named_parameters() mean the same under every strategy, with default
// options: every module parameter, frozen ones included, in module order, under its name
// and full shape (FSDP: this rank's part of a trainable one, a frozen one whole).
TEST(ParamGroups, EveryStrategyListsEveryParameterByDefault) {
  at::set_num_threads(1);
  auto make = [] {
    torch::manual_seed(3);
    auto m = make_model(Model::kTransformer, 7);
    m->named_parameters()["wpe.weight"].requires_grad_(false);  // a frozen table
    return m;
  };
  auto listing = [](Strategy& s) {
    std::vector<std::string> out;
    for (const auto& p : s.named_parameters()) out.push_back(fmt::format("{} {}", p.name, p.shape));
    return out;
  };
  auto single_model = make();
  SingleDevice single(single_model);
  const std::vector<std::string> want = listing(single);
  ASSERT_EQ(static_cast<int64_t>(want.size()),
            static_cast<int64_t>(single_model->parameters().size()));
  std::vector<std::vector<std::string>> ddp(2), fsdp(2);
  std::vector<size_t> ddp_count(2), fsdp_count(2);
  // Built before the rank threads: make_model seeds the one global generator.
  std::vector<std::shared_ptr<torch::nn::Module>> for_ddp, for_fsdp;
  for (int r = 0; r < 2; ++r) {
    for_ddp.push_back(make());
    for_fsdp.push_back(make());
  }
  run_ranks(2, [&](Communicator& comm) {
    const size_t r = static_cast<size_t>(comm.rank());
    auto a = for_ddp[r];
    DataParallel d(a, borrowed(comm));
    ddp[r] = listing(d);
    ddp_count[r] = d.parameters().size();
    auto b = for_fsdp[r];
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("BlockImpl");
    FullyShardedDataParallel f(b, borrowed(comm), o);
    fsdp[r] = listing(f);
    fsdp_count[r] = f.parameters().size();
    const at::Tensor frozen = f.named_parameters()[1].tensor;  // wpe.weight, whole
    DTRAIN_CHECK(f.named_parameters()[1].name == "wpe.weight" && !frozen.requires_grad() &&
                     frozen.sizes() == b->named_parameters()["wpe.weight"].sizes(),
                 "rank {}: the frozen table is not listed whole", r);
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(ddp[r], want) << "DDP rank " << r;
    EXPECT_EQ(fsdp[r], want) << "FSDP rank " << r;
    EXPECT_EQ(ddp_count[r], want.size());
    EXPECT_EQ(fsdp_count[r], want.size());
  }
}

// Trained 2 steps under FSDP x2, saved (sharded), resumed for 2 more under FSDP x3 and under
// SingleDevice: both end where 4 uninterrupted single-device steps end, which needs every
// view's AdamW moments and step count re-sliced onto the new layout.
TEST(ParamGroups, PerViewOptimizerStateResumesOnAnotherWorldSize) {
  at::set_num_threads(1);
  constexpr int64_t kRows = 6;  // the global batch: 3 rows per rank x2, 2 per rank x3
  const auto data = make_data(Model::kTransformer, 2);
  GroupCase c;
  auto ref = make_model(Model::kTransformer, 7);
  SingleDevice single(ref);
  auto ref_opt = grouped_adamw(single);
  train_steps(single, *ref, *ref_opt, data, 0, kSteps, 0, kRows, c, false);

  // Models are made before the ranks start: make_model seeds the global generator, which
  // threads would share (rank 0's initialization, broadcast to all, would come out wrong).
  std::vector<std::shared_ptr<torch::nn::Module>> before, after;
  for (int r = 0; r < 2; ++r) before.push_back(make_model(Model::kTransformer, 7));
  for (int r = 0; r < 3; ++r) after.push_back(make_model(Model::kTransformer, 100 + r));
  TempDir dir("param_groups");
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    auto& m = before[r];
    FullyShardedDataParallel s(m, borrowed(comm), fsdp_options(c, HybridGroups{}));
    auto opt = grouped_adamw(s);
    train_steps(s, *m, *opt, data, 0, 2, r * 3, 3, c, false);
    TrainingState state;
    state.step = 2;
    save_checkpoint(dir.path().string(), s, opt.get(), state);
  });
  const std::string saved = latest_checkpoint(dir.path().string());
  ASSERT_FALSE(saved.empty());

  run_ranks(3, [&](Communicator& comm) {
    const int r = comm.rank();
    auto& m = after[r];
    FullyShardedDataParallel s(m, borrowed(comm), fsdp_options(c, HybridGroups{}));
    auto opt = grouped_adamw(s);
    DTRAIN_CHECK(load_checkpoint(saved, s, opt.get()).step == 2, "step");
    train_steps(s, *m, *opt, data, 2, kSteps, r * 2, 2, c, false);
    auto state = s.full_state_dict();
    if (r == 0) expect_state_matches(state, *ref, c.rtol, c.atol);
  });

  auto m = make_model(Model::kTransformer, 100);
  SingleDevice resumed(m);
  auto opt = grouped_adamw(resumed);
  load_checkpoint(saved, resumed, opt.get());
  train_steps(resumed, *m, *opt, data, 2, kSteps, 0, kRows, c, false);
  expect_same_parameters(*ref, *m, 0, c.rtol, c.atol);
}

}  // namespace
}  // namespace dtrain

// The mistakes of a user's first hour (issue 44), each reproduced as the user made it:
// FSDP bf16 with BatchNorm fed fp32 inputs, a forward outside strategy->forward(), uneven
// data followed by an evaluation, a forgotten finish(), a wrap policy that wraps nothing.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "compat/warnings.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/sync_batch_norm.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

CommunicatorPtr borrow(Communicator& c) {
  return std::shared_ptr<Communicator>(&c, [](Communicator*) {});
}

CommunicatorOptions short_timeout() {
  CommunicatorOptions o;
  o.timeout = std::chrono::seconds(4);
  return o;
}

enum class Kind { kDdp, kFsdp };

std::unique_ptr<Strategy> make_strategy(Kind k, std::shared_ptr<torch::nn::Module> m,
                                        Communicator& comm) {
  if (k == Kind::kDdp) return std::make_unique<DataParallel>(m, borrow(comm));
  return std::make_unique<FullyShardedDataParallel>(m, borrow(comm));
}

std::string kind_name(const ::testing::TestParamInfo<Kind>& info) {
  return info.param == Kind::kDdp ? "ddp" : "fsdp";
}

// One SGD step of the MLP on this rank's rows of batch `s`.
void mlp_step(Strategy& s, MlpImpl& mlp, const std::vector<Batch>& data, int step, int rank) {
  at::Tensor x = data[static_cast<size_t>(step)].x.narrow(0, rank * kLocalBatch, kLocalBatch);
  at::Tensor y = data[static_cast<size_t>(step)].y.narrow(0, rank * kLocalBatch, kLocalBatch);
  at::Tensor l = s.forward([&] { return at::mse_loss(mlp.forward(x), y); });
  s.backward(l);
}

// --- bf16 FSDP with BatchNorm, fp32 inputs (the user's CNN) ---

constexpr int64_t kImages = 4;  // per rank

// conv, norm, relu, conv, norm, relu, pool, flatten, linear: entries "0" ... "8".
std::shared_ptr<torch::nn::SequentialImpl> make_cnn() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                               torch::nn::BatchNorm2d(8), torch::nn::ReLU(),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)),
                               torch::nn::BatchNorm2d(8), torch::nn::ReLU(),
                               torch::nn::AdaptiveAvgPool2d(1), torch::nn::Flatten(),
                               torch::nn::Linear(8, 4))
      .ptr();
}

struct CnnData {
  std::vector<at::Tensor> x, y;
  at::Tensor eval_x;
};

CnnData make_cnn_data(int world, int steps) {
  torch::manual_seed(5);
  CnnData d;
  for (int s = 0; s < steps; ++s) {
    d.x.push_back(at::randn({kImages * world, 3, 6, 6}) * 2 + 0.5);
    d.y.push_back(at::randint(0, 4, {kImages * world}));
  }
  d.eval_x = at::randn({kImages * world, 3, 6, 6});
  return d;
}

// The user's loop: fp32 images in, whatever the strategy's precision.
void train_cnn(Strategy& strategy, torch::nn::SequentialImpl& model, const CnnData& d, int rank) {
  torch::optim::SGD opt(strategy.parameters(), torch::optim::SGDOptions(0.1));
  for (size_t s = 0; s < d.x.size(); ++s) {
    at::Tensor x = d.x[s].narrow(0, rank * kImages, kImages);
    at::Tensor y = d.y[s].narrow(0, rank * kImages, kImages);
    opt.zero_grad();
    at::Tensor loss = strategy.forward([&] { return at::cross_entropy_loss(model.forward(x), y); });
    strategy.backward(loss);
    opt.step();
  }
}

at::Tensor eval_cnn(Strategy& strategy, torch::nn::SequentialImpl& model, const CnnData& d,
                    int rank) {
  model.eval();
  c10::NoGradGuard no_grad;
  at::Tensor x = d.eval_x.narrow(0, rank * kImages, kImages);
  return strategy.forward([&] { return model.forward(x); }).to(at::kFloat);
}

struct NormCase {
  std::string name;
  bool sync = false;   // dtrain::SyncBatchNorm instead of BatchNorm2d
  bool units = false;  // the second conv and its norm are units of their own
};
void PrintTo(const NormCase& c, std::ostream* os) { *os << c.name; }

class FsdpBf16Norm : public ::testing::TestWithParam<NormCase> {};

// FSDP with param_dtype bf16 and no buffer_dtype, fed fp32 images, trains as DataParallel in
// fp32 does (to bf16's precision), keeps fp32 statistics, and evaluates.
TEST_P(FsdpBf16Norm, TrainsAndEvaluatesFromFp32InputsWithFp32Statistics) {
  const NormCase nc = GetParam();
  const int world = 2;
  at::set_num_threads(1);
  const CnnData data = make_cnn_data(world, 3);
  std::vector<std::shared_ptr<torch::nn::SequentialImpl>> ddp_models, fsdp_models;
  for (int r = 0; r < world; ++r) {
    ddp_models.push_back(make_cnn());
    fsdp_models.push_back(make_cnn());
  }
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    auto ddp_model = ddp_models[static_cast<size_t>(r)];
    auto model = fsdp_models[static_cast<size_t>(r)];
    if (nc.sync) {
      convert_sync_batch_norm(ddp_model, borrow(comm));
      convert_sync_batch_norm(model, borrow(comm));
    }
    // Each rank's statistics its own, as under FSDP (which broadcasts buffers once).
    DataParallelOptions dopt;
    dopt.broadcast_buffers = false;
    DataParallel ddp(ddp_model, borrow(comm), dopt);
    train_cnn(ddp, *ddp_model, data, r);
    const at::Tensor ddp_eval = eval_cnn(ddp, *ddp_model, data, r);
    ddp.finish();

    FsdpOptions o;
    o.mixed_precision.param_dtype = at::kBFloat16;
    if (nc.units) {
      o.wrap_policy = [](const std::string& name, const torch::nn::Module&) {
        return name == "3" || name == "4";
      };
    }
    FullyShardedDataParallel fsdp(model, borrow(comm), o);
    train_cnn(fsdp, *model, data, r);
    const at::Tensor fsdp_eval = eval_cnn(fsdp, *model, data, r);
    auto state = fsdp.full_state_dict();
    fsdp.finish();

    // Statistics: fp32, and this rank's (or, synchronised, the global batch's) as under DDP.
    const auto want = ddp_model->named_buffers();
    for (const auto& item : model->named_buffers()) {
      const at::Tensor& b = item.value();
      if (!b.is_floating_point()) continue;
      DTRAIN_CHECK(b.scalar_type() == at::kFloat, "{} is {}", item.key(),
                   c10::toString(b.scalar_type()));
      DTRAIN_CHECK(at::allclose(b, want[item.key()], 2e-2, 2e-2), "{}: max |diff| {}", item.key(),
                   (b - want[item.key()]).abs().max().item<double>());
    }
    DTRAIN_CHECK(at::allclose(fsdp_eval, ddp_eval, 5e-2, 5e-2), "eval output: max |diff| {}",
                 (fsdp_eval - ddp_eval).abs().max().item<double>());
    if (r == 0) {
      const auto params = ddp_model->named_parameters();
      for (const auto& [name, t] : state) {
        if (!params.contains(name)) continue;
        DTRAIN_CHECK(at::allclose(t, params[name], 2e-2, 2e-2), "{}: max |diff| {}", name,
                     (t - params[name]).abs().max().item<double>());
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(FirstHour, FsdpBf16Norm,
                         ::testing::Values(NormCase{"batch_norm_root", false, false},
                                           NormCase{"batch_norm_units", false, true},
                                           NormCase{"sync_batch_norm_root", true, false},
                                           NormCase{"sync_batch_norm_units", true, true}),
                         [](const auto& info) { return info.param.name; });

// --- a forward outside strategy->forward() ---

// Two units called through dtrain::unit_call; the root has no parameters of its own.
struct TwoUnitsImpl : torch::nn::Module {
  TwoUnitsImpl()
      : a(register_module("a", torch::nn::Linear(6, 8))),
        b(register_module("b", torch::nn::Linear(8, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = unit_call(*a, [&] { return at::tanh(a->forward(x)); });
    return unit_call(*b, [&] { return b->forward(h); });
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(TwoUnits);

class FsdpForwardOutside : public ::testing::TestWithParam<ShardingStrategy> {};

// Sequential entries FSDP routes: caught under every sharding strategy (NO_SHARD keeps the
// parameters, which would silently be the last gathered ones).
TEST_P(FsdpForwardOutside, SequentialUnitNamesTheMistake) {
  at::set_num_threads(1);
  const auto data = make_data(Model::kMlp, 2);
  std::vector<std::shared_ptr<torch::nn::SequentialImpl>> models;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(3);
    models.push_back(
        torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 4))
            .ptr());
  }
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    auto model = models[static_cast<size_t>(r)];
    FsdpOptions o;
    o.sharding = GetParam();
    o.wrap_policy = [](const std::string& name, const torch::nn::Module&) {
      return name == "0" || name == "2";
    };
    FullyShardedDataParallel fsdp(model, borrow(comm), o);
    at::Tensor x = data[0].x.narrow(0, r * kLocalBatch, kLocalBatch);
    at::Tensor y = data[0].y.narrow(0, r * kLocalBatch, kLocalBatch);
    fsdp.backward(fsdp.forward([&] { return at::mse_loss(model->forward(x), y); }));
    std::string what;
    try {
      c10::NoGradGuard no_grad;
      model->forward(x);  // the user's evaluation
    } catch (const InvalidArgument& e) {
      what = e.what();
    }
    DTRAIN_CHECK(what.find("the forward of FSDP unit '0' (torch::nn::LinearImpl) ran outside "
                           "strategy->forward()") != std::string::npos,
                 "{}", what);
    // The strategy is untouched: the same evaluation through it works.
    c10::NoGradGuard no_grad;
    fsdp.forward([&] { return model->forward(x); });
    fsdp.finish();
  });
}

// unit_call units: caught once their parameters are freed.
TEST_P(FsdpForwardOutside, UnitCallNamesTheMistake) {
  if (GetParam() == ShardingStrategy::kNoShard) GTEST_SKIP() << "NO_SHARD never frees";
  at::set_num_threads(1);
  const auto data = make_data(Model::kMlp, 2);
  std::vector<TwoUnits> models;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(3);
    models.emplace_back();
  }
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    TwoUnits model = models[static_cast<size_t>(r)];
    FsdpOptions o;
    o.sharding = GetParam();
    o.wrap_policy = [](const std::string& name, const torch::nn::Module&) {
      return name == "a" || name == "b";
    };
    FullyShardedDataParallel fsdp(model.ptr(), borrow(comm), o);
    at::Tensor x = data[0].x.narrow(0, r * kLocalBatch, kLocalBatch);
    at::Tensor y = data[0].y.narrow(0, r * kLocalBatch, kLocalBatch);
    fsdp.backward(fsdp.forward([&] { return at::mse_loss(model->forward(x), y); }));
    std::string what;
    try {
      model->forward(x);
    } catch (const InvalidArgument& e) {
      what = e.what();
    }
    DTRAIN_CHECK(what.find("the forward of FSDP unit torch::nn::LinearImpl ran outside "
                           "strategy->forward()") != std::string::npos,
                 "{}", what);
    fsdp.backward(fsdp.forward([&] { return at::mse_loss(model->forward(x), y); }));
    fsdp.finish();
  });
}

INSTANTIATE_TEST_SUITE_P(FirstHour, FsdpForwardOutside,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard),
                         [](const auto& info) {
                           switch (info.param) {
                             case ShardingStrategy::kFullShard:
                               return std::string("full_shard");
                             case ShardingStrategy::kShardGradOp:
                               return std::string("shard_grad_op");
                             default:
                               return std::string("no_shard");
                           }
                         });

// --- uneven data, then evaluation ---

class StepSyncMistakes : public ::testing::TestWithParam<Kind> {};

// Rank 1 has 2 batches, rank 0 has 3; the natural loop: train, evaluate, finish().
TEST_P(StepSyncMistakes, EvaluationWhileAnotherRankTrainsNamesTheMistake) {
  at::set_num_threads(1);
  const auto data = make_data(Model::kMlp, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < 2; ++r) modules.push_back(make_model(Model::kMlp, 7));
  std::vector<std::string> errors(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        const int r = comm.rank();
        auto s = make_strategy(GetParam(), modules[static_cast<size_t>(r)], comm);
        auto& mlp = static_cast<MlpImpl&>(*modules[static_cast<size_t>(r)]);
        try {
          for (int step = 0; step < (r == 1 ? 2 : 3); ++step) mlp_step(*s, mlp, data, step, r);
          {
            c10::NoGradGuard no_grad;
            s->forward([&] { return mlp.forward(data[0].x); });
          }
          s->finish();
        } catch (const InvalidArgument& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      },
      short_timeout());
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 1 ran an evaluation forward at step 2 while rank 0 ran a "
                             "training step"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("must call finish() before evaluating"), std::string::npos)
        << errors[r];
  }
}

// --- finish() forgotten ---

// Runs `steps` training steps on 2 ranks, then (with `finish`) finish(), and returns each
// rank's warnings from the strategy's destruction.
std::vector<std::vector<std::string>> warnings_at_destruction(Kind kind, int steps, bool finish,
                                                              bool throw_after) {
  at::set_num_threads(1);
  const auto data = make_data(Model::kMlp, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < 2; ++r) modules.push_back(make_model(Model::kMlp, 7));
  std::vector<std::vector<std::string>> warnings(2);
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    compat::WarningCapture capture;
    try {
      auto s = make_strategy(kind, modules[static_cast<size_t>(r)], comm);
      auto& mlp = static_cast<MlpImpl&>(*modules[static_cast<size_t>(r)]);
      for (int step = 0; step < steps; ++step) mlp_step(*s, mlp, data, step, r);
      if (finish) s->finish();
      if (throw_after) throw std::runtime_error("the user's loop failed");
    } catch (const std::runtime_error&) {
    }
    warnings[static_cast<size_t>(r)] = capture.messages();
  });
  return warnings;
}

TEST_P(StepSyncMistakes, ForgottenFinishWarnsNamingStrategyAndRank) {
  const auto w = warnings_at_destruction(GetParam(), 2, /*finish=*/false, /*throw_after=*/false);
  const std::string name = GetParam() == Kind::kDdp ? "DataParallel" : "FullyShardedDataParallel";
  for (int r = 0; r < 2; ++r) {
    const auto& mine = w[static_cast<size_t>(r)];
    ASSERT_EQ(mine.size(), 1u) << "rank " << r;
    EXPECT_NE(mine[0].find(name + " (rank " + std::to_string(r) +
                           " of 2) destroyed after training steps without finish()"),
              std::string::npos)
        << mine[0];
  }
}

TEST_P(StepSyncMistakes, NoWarningWithFinishWithoutStepsOrWhileUnwinding) {
  for (const auto& w : warnings_at_destruction(GetParam(), 2, /*finish=*/true, false)) {
    EXPECT_TRUE(w.empty()) << w.front();
  }
  for (const auto& w : warnings_at_destruction(GetParam(), 0, /*finish=*/false, false)) {
    EXPECT_TRUE(w.empty()) << w.front();
  }
  for (const auto& w : warnings_at_destruction(GetParam(), 2, /*finish=*/false, true)) {
    EXPECT_TRUE(w.empty()) << w.front();
  }
}

INSTANTIATE_TEST_SUITE_P(FirstHour, StepSyncMistakes, ::testing::Values(Kind::kDdp, Kind::kFsdp),
                         kind_name);

// --- a wrap policy that wraps nothing ---

TEST(FsdpWrapPolicy, MatchingNoSubmoduleIsInvalidArgument) {
  auto model = make_model(Model::kMlp, 7);
  run_ranks(1, [&](Communicator& comm) {
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("Block");  // an MLP has none
    std::string what;
    try {
      FullyShardedDataParallel fsdp(model, borrow(comm), o);
    } catch (const InvalidArgument& e) {
      what = e.what();
    }
    DTRAIN_CHECK(what.find("the wrap policy matched no submodule") != std::string::npos, "{}",
                 what);
    // No policy: the root alone, as documented.
    FullyShardedDataParallel root_only(model, borrow(comm), FsdpOptions{});
  });
  auto again = make_model(Model::kMlp, 7);
  run_ranks(1, [&](Communicator& comm) {
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("Linear");
    FullyShardedDataParallel fsdp(again, borrow(comm), o);
  });
}

}  // namespace
}  // namespace dtrain

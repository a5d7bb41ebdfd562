// Shared by the DataParallel tests and the multi-process test worker: small models, a
// deterministic global batch per step, and the training loop every strategy runs.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "dtrain/comm_hook.h"
#include "dtrain/data_parallel.h"
#include "dtrain/single_device.h"
#include "dtrain/strategy.h"
#include "strategy/test_models.h"
#include "support/check.h"

namespace dtrain::testing {

constexpr int kSteps = 4;
constexpr int64_t kLocalBatch = 3;

enum class Model { kMlp, kTransformer };
enum class Opt { kSgd, kAdamW };

struct Case {
  std::string name;
  Model model = Model::kMlp;
  Opt opt = Opt::kSgd;
  std::function<std::shared_ptr<CommHook>()> hook;  // null: default
  bool accumulate = false;  // two micro-batches per step, the first under no_sync()
  bool skip_extra = false;  // the MLP's extra branch is used on even steps only
  // With accumulate: the MLP's extra branch is used in each step's first micro-batch (the
  // no_sync one) only. The reference accumulates the same micro-batches of every rank.
  bool extra_in_first_micro_batch_only = false;
  bool find_unused = false;
  bool set_to_none = false;  // reset .grad to undefined (2.x zero_grad) instead of zeroing (1.13)
  double clip = 0;           // clip_grad_norm(clip) before each step when > 0
  double rtol = 1e-5;
  double atol = 1e-6;
  double bucket_mb = 25, first_bucket_mb = 1;
};
// Test names and failure messages show the case's name, not its bytes.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

inline std::shared_ptr<torch::nn::Module> make_model(Model m, uint64_t seed) {
  torch::manual_seed(seed);
  if (m == Model::kMlp) return Mlp(6, 16, 4, /*with_extra=*/true).ptr();
  return TinyTransformer(/*vocab=*/50, /*ctx=*/8, /*dim=*/16, /*heads=*/2, /*layers=*/2).ptr();
}

struct Batch {
  at::Tensor x, y;
};

inline std::vector<Batch> make_data(Model m, int world) {
  torch::manual_seed(1234);
  std::vector<Batch> steps;
  for (int s = 0; s < kSteps; ++s) {
    const int64_t n = kLocalBatch * world;
    if (m == Model::kMlp) {
      steps.push_back({at::randn({n, 6}), at::randn({n, 4})});
    } else {
      steps.push_back({at::randint(0, 50, {n, 8}), at::randint(0, 50, {n, 8})});
    }
  }
  return steps;
}

inline at::Tensor loss_of(Model m, torch::nn::Module& module, const at::Tensor& x,
                          const at::Tensor& y, bool use_extra) {
  if (m == Model::kMlp) {
    auto& mlp = static_cast<testing::MlpImpl&>(module);
    return at::mse_loss(mlp.forward(x, use_extra), y);
  }
  auto& tf = static_cast<testing::TinyTransformerImpl&>(module);
  at::Tensor logits = tf.forward(x);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

inline std::unique_ptr<torch::optim::Optimizer> make_opt(Opt o, std::vector<at::Tensor> params) {
  if (o == Opt::kSgd) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  // eps well above round-off: some gradients are zero in exact arithmetic (attention's key
  // bias cancels in softmax), and with eps = 1e-8 Adam blows their round-off (1e-9, different
  // in every summation order) up to full-size steps, which would make any comparison noise.
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-4));
}

// Zeroes every gradient the optimizer holds in place, keeping it defined: LibTorch 1.13's
// Optimizer::zero_grad(). From 2.0 zero_grad() resets gradients to undefined by default
// instead (what Case::set_to_none does); tests whose expectation depends on which of the two
// happened say which one they mean with this function or with a reset.
inline void zero_grad_in_place(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

// Trains with `strategy` on rows [row0, row0 + rows) of each global batch. `accumulating`: the
// strategy under test, which with c.accumulate runs each step as two micro-batches, the first
// under its no_sync(); null (the single-device reference): one batch per step.
inline void train(const Case& c, Strategy& strategy, torch::nn::Module& module,
                  const std::vector<Batch>& data, int64_t row0, int64_t rows,
                  Strategy* accumulating) {
  auto opt = make_opt(c.opt, strategy.parameters());
  for (int s = 0; s < kSteps; ++s) {
    const bool use_extra = !c.skip_extra || s % 2 == 0;
    at::Tensor x = data[s].x.narrow(0, row0, rows);
    at::Tensor y = data[s].y.narrow(0, row0, rows);
    if (c.set_to_none) {
      for (auto& p : strategy.parameters()) p.mutable_grad().reset();
    } else {
      zero_grad_in_place(*opt);
    }
    const bool extra_later = use_extra && !c.extra_in_first_micro_batch_only;
    if (c.accumulate && accumulating != nullptr) {
      const int64_t half = rows / 2;
      {
        auto guard = accumulating->no_sync();
        at::Tensor l = strategy.forward([&] {
          return loss_of(c.model, module, x.narrow(0, 0, half), y.narrow(0, 0, half), use_extra);
        });
        strategy.backward(l * (double(half) / rows));
      }
      at::Tensor l = strategy.forward([&] {
        return loss_of(c.model, module, x.narrow(0, half, rows - half),
                       y.narrow(0, half, rows - half), extra_later);
      });
      strategy.backward(l * (double(rows - half) / rows));
    } else if (c.accumulate && c.extra_in_first_micro_batch_only) {
      // The reference: every rank's two micro-batches in one loss, weighted as the ranks do.
      at::Tensor l = strategy.forward([&] {
        const int64_t half = kLocalBatch / 2;
        at::Tensor sum;
        for (int64_t r0 = 0; r0 < rows; r0 += kLocalBatch) {
          at::Tensor a =
              loss_of(c.model, module, x.narrow(0, r0, half), y.narrow(0, r0, half), use_extra) *
              (double(half) / rows);
          at::Tensor b = loss_of(c.model, module, x.narrow(0, r0 + half, kLocalBatch - half),
                                 y.narrow(0, r0 + half, kLocalBatch - half), extra_later) *
                         (double(kLocalBatch - half) / rows);
          sum = sum.defined() ? sum + a + b : a + b;
        }
        return sum;
      });
      strategy.backward(l);
    } else {
      at::Tensor l = strategy.forward([&] { return loss_of(c.model, module, x, y, use_extra); });
      strategy.backward(l);
    }
    if (c.clip > 0) strategy.clip_grad_norm(c.clip);
    opt->step();
  }
}

inline void expect_same_parameters(const torch::nn::Module& ref, const torch::nn::Module& got,
                                   int rank, double rtol, double atol) {
  auto a = ref.named_parameters();
  auto b = got.named_parameters();
  DTRAIN_CHECK(a.size() == b.size(), "parameter count");
  for (const auto& item : a) {
    const at::Tensor& want = item.value();
    const at::Tensor& have = b[item.key()];
    const double err = (have - want).abs().max().item<double>();
    DTRAIN_CHECK(at::allclose(have, want, rtol, atol),
                 "rank {} parameter {} differs from single-device training: max |diff| {}", rank,
                 item.key(), err);
  }
}

// The reference every equivalence test compares with: the model of seed 7 trained by
// SingleDevice on each step's whole global batch of `world` ranks.
inline std::shared_ptr<torch::nn::Module> single_device_reference(const Case& c,
                                                                  const std::vector<Batch>& data,
                                                                  int world) {
  auto ref = make_model(c.model, 7);
  SingleDevice single(ref);
  train(c, single, *ref, data, 0, kLocalBatch * world, nullptr);
  return ref;
}

// One model per rank, built before the rank threads start (make_model seeds LibTorch's one
// global generator): rank 0's equals the reference's initial weights, the others differ,
// so a strategy must overwrite them with rank 0's.
inline std::vector<std::shared_ptr<torch::nn::Module>> rank_models(
    Model m, int world, c10::Device device = c10::Device(c10::kCPU)) {
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) {
    modules.push_back(make_model(m, r == 0 ? 7 : 100 + r));
    modules.back()->to(device);
  }
  return modules;
}

// DataParallel as the case asks for it.
inline DataParallelOptions ddp_options(const Case& c) {
  DataParallelOptions o;
  o.comm_hook = c.hook ? c.hook() : nullptr;
  o.find_unused_parameters = c.find_unused;
  o.bucket_cap_mb = c.bucket_mb;
  o.first_bucket_cap_mb = c.first_bucket_mb;
  return o;
}

}  // namespace dtrain::testing

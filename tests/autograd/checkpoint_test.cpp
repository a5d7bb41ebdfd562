// Activation checkpointing: the same loss and gradients as a plain forward (fp32, 1e-6
// relative), with dropout (the recompute replays the random stream), when no input requires
// grad, with several outputs, and under DataParallel (its hooks fire from the recompute).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/container/modulelist.h>

#include <memory>
#include <vector>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "strategy/test_models.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// The tiny transformer's pattern with dropout after every block; `checkpointed` wraps each
// block (dropout included) in dtrain::checkpoint.
struct DropoutNetImpl : torch::nn::Module {
  explicit DropoutNetImpl(bool checkpointed, double p = 0.2) : checkpointed(checkpointed), p(p) {
    wte = register_module("wte", torch::nn::Embedding(40, 16));
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), Block(16, 2)));
  }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor x = wte->forward(idx);
    for (auto& b : blocks) {
      auto block = [b, p = p](const at::Tensor& in) mutable {
        return at::dropout(b->forward(in), p, true);
      };
      // unit_call outside: FSDP gathers the unit for the forward and again before the
      // recompute (its pre-backward hook on the output), as for any unit.
      x = dtrain::unit_call(*b,
                            [&] { return checkpointed ? dtrain::checkpoint(block, x) : block(x); });
    }
    return at::matmul(x, wte->weight.t());
  }
  bool checkpointed;
  double p;
  torch::nn::Embedding wte{nullptr};
  std::vector<Block> blocks;
};
TORCH_MODULE(DropoutNet);

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

void expect_close_gradients(torch::nn::Module& want, torch::nn::Module& got, double rtol) {
  auto a = want.named_parameters(), b = got.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor ga = a[i].value().grad(), gb = b[i].value().grad();
    ASSERT_TRUE(ga.defined() && gb.defined()) << a[i].key();
    const double scale = ga.abs().max().item<double>();
    EXPECT_LE((ga - gb).abs().max().item<double>(), rtol * scale + 1e-12) << a[i].key();
  }
}

TEST(ActivationCheckpoint, SameGradientsAsAPlainForwardWithDropout) {
  at::set_num_threads(1);
  torch::manual_seed(3);
  DropoutNet plain(false), ckpt(true);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < plain->parameters().size(); ++i) {
    ckpt->parameters()[i].copy_(plain->parameters()[i]);
  }
  const at::Tensor idx = at::randint(40, {4, 8}, at::kLong);
  const at::Tensor targets = at::randint(40, {4, 8}, at::kLong);

  auto run = [&](DropoutNet& net) {
    at::AutoGradMode grad(true);
    torch::manual_seed(11);
    at::Tensor loss = loss_of(net->forward(idx), targets);
    loss.backward();
    // The random stream continues where the forward left it, recompute or not.
    return std::make_pair(loss.item<double>(), at::rand({4}));
  };
  const auto [loss_plain, next_plain] = run(plain);
  const auto [loss_ckpt, next_ckpt] = run(ckpt);
  EXPECT_NEAR(loss_ckpt, loss_plain, 1e-6 * std::abs(loss_plain));
  expect_close_gradients(*plain, *ckpt, 1e-6);
  EXPECT_TRUE(at::equal(next_plain, next_ckpt));
}

TEST(ActivationCheckpoint, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(5);
  auto lin = torch::nn::Linear(6, 3);
  const at::Tensor x = at::randn({5, 6});  // requires no grad: only the weights do
  at::Tensor y =
      dtrain::checkpoint([&](const at::Tensor& in) { return at::tanh(lin->forward(in)); }, x);
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  const at::Tensor g = lin->weight.grad().clone();
  lin->zero_grad();
  at::tanh(lin->forward(x)).sum().backward();
  EXPECT_TRUE(at::allclose(g, lin->weight.grad(), 1e-6, 1e-7));
  EXPECT_FALSE(x.grad().defined());
}

TEST(ActivationCheckpoint, SeveralInputsAndOutputs) {
  torch::manual_seed(6);
  const at::Tensor a = at::randn({3, 4}).requires_grad_(), b = at::randn({3, 4}).requires_grad_();
  auto fn = [](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::sin(in[0]) * in[1], in[0].exp(), in[1] * 2};
  };
  auto out = dtrain::checkpoint(fn, {a, b});
  ASSERT_EQ(out.size(), 3u);
  (out[0].sum() + out[1].pow(2).sum()).backward();  // out[2] unused: no gradient flows from it
  const at::Tensor ga = a.grad().clone(), gb = b.grad().clone();
  a.mutable_grad().reset();
  b.mutable_grad().reset();
  auto ref = fn({a, b});
  (ref[0].sum() + ref[1].pow(2).sum()).backward();
  EXPECT_TRUE(at::allclose(ga, a.grad(), 1e-6, 1e-7));
  EXPECT_TRUE(at::allclose(gb, b.grad(), 1e-6, 1e-7));
}

TEST(ActivationCheckpoint, WithoutGradModeItJustRuns) {
  at::NoGradGuard no_grad;
  const at::Tensor x = at::ones({2});
  at::Tensor y = dtrain::checkpoint([](const at::Tensor& in) { return in * 3; }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(at::equal(y, at::full({2}, 3.0f)));
}

TEST(ActivationCheckpoint, UndefinedInputIsRefused) {
  EXPECT_THROW(dtrain::checkpoint([](const at::Tensor& in) { return in; }, at::Tensor()),
               InvalidArgument);
}

// Two ranks' plain and checkpointed replicas, all with the same weights, and a global batch
// of 4 sequences (2 per rank). No dropout: thread ranks share the process's CPU generator,
// so their draws would interleave differently in the two runs.
struct Replicas {
  Replicas() {
    torch::manual_seed(9);
    idx = at::randint(40, {4, 8}, at::kLong);
    targets = at::randint(40, {4, 8}, at::kLong);
    for (int r = 0; r < 2; ++r) {
      plain.emplace_back(false, 0.0);
      ckpt.emplace_back(true, 0.0);
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < plain[r]->parameters().size(); ++i) {
        ckpt[r]->parameters()[i].copy_(plain[0]->parameters()[i]);
        plain[r]->parameters()[i].copy_(plain[0]->parameters()[i]);
      }
    }
  }
  at::Tensor idx, targets;
  std::vector<DropoutNet> plain, ckpt;
};

// Two ranks, each a checkpointed and a plain replica under DataParallel: after three SGD
// steps on the same data the parameters agree.
TEST(ActivationCheckpoint, DataParallelHooksFireFromTheRecompute) {
  const Replicas m;
  const at::Tensor &idx = m.idx, &targets = m.targets;
  const auto &plain = m.plain, &ckpt = m.ckpt;
  auto train = [&](Communicator& comm, DropoutNet net) {
    at::set_num_threads(1);
    const int r = comm.rank();
    DataParallel ddp(net.ptr(), std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    for (int step = 0; step < 3; ++step) {
      net->zero_grad();
      at::Tensor loss = ddp.forward([&] {
        return loss_of(net->forward(idx.narrow(0, 2 * r, 2)), targets.narrow(0, 2 * r, 2));
      });
      ddp.backward(loss);
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.sub_(p.grad(), 0.1);
    }
  };
  run_ranks(2, [&](Communicator& comm) { train(comm, plain[comm.rank()]); });
  run_ranks(2, [&](Communicator& comm) { train(comm, ckpt[comm.rank()]); });
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < plain[r]->parameters().size(); ++i) {
      EXPECT_TRUE(at::allclose(plain[r]->parameters()[i], ckpt[r]->parameters()[i], 1e-5, 1e-6))
          << "rank " << r << " parameter " << i;
    }
  }
}

// The same under FSDP with a unit per block: the checkpointed units are gathered again for
// the recompute and reduce-scatter the recomputed gradients.
TEST(ActivationCheckpoint, FsdpUnitsAreGatheredForTheRecompute) {
  const Replicas m;
  const at::Tensor &idx = m.idx, &targets = m.targets;
  const auto &plain = m.plain, &ckpt = m.ckpt;
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> plain_state(2), ckpt_state(2);
  auto train = [&](Communicator& comm, DropoutNet net,
                   std::vector<std::pair<std::string, at::Tensor>>& state) {
    at::set_num_threads(1);
    const int r = comm.rank();
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("BlockImpl");
    FullyShardedDataParallel fsdp(net.ptr(),
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    for (int step = 0; step < 3; ++step) {
      for (auto& p : fsdp.parameters()) p.mutable_grad().reset();
      at::Tensor loss = fsdp.forward([&] {
        return loss_of(net->forward(idx.narrow(0, 2 * r, 2)), targets.narrow(0, 2 * r, 2));
      });
      fsdp.backward(loss);
      torch::NoGradGuard no_grad;
      for (auto& p : fsdp.parameters()) p.sub_(p.grad(), 0.1);
    }
    state = fsdp.full_state_dict();
  };
  run_ranks(2,
            [&](Communicator& comm) { train(comm, plain[comm.rank()], plain_state[comm.rank()]); });
  run_ranks(2,
            [&](Communicator& comm) { train(comm, ckpt[comm.rank()], ckpt_state[comm.rank()]); });
  ASSERT_EQ(plain_state[0].size(), ckpt_state[0].size());
  ASSERT_FALSE(plain_state[0].empty());  // rank 0 holds the full state
  for (size_t i = 0; i < plain_state[0].size(); ++i) {
    EXPECT_TRUE(at::allclose(plain_state[0][i].second, ckpt_state[0][i].second, 1e-5, 1e-6))
        << plain_state[0][i].first;
  }
}

}  // namespace
}  // namespace dtrain

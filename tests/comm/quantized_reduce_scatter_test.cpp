// FSDP's quantised gradient reduce-scatter (FsdpOptions::quantize_grads): the exchange
// schedule, the result against Communicator::reduce_scatter in fp32 within the bound derived
// in compress/quantized_reduce_scatter.h (odd sizes, zeros, 2 to 4 ranks), and FSDP training
// with int8 gradients against fp32.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <set>
#include <tuple>
#include <utility>

#include "compress/quantize.h"
#include "compress/quantized_reduce_scatter.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/quantization.h"
#include "strategy/test_models.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// Every round pairs ranks symmetrically, and every pair meets exactly once.
TEST(QuantizedReduceScatter, ExchangeMeetsEveryPeerOnce) {
  for (int world = 1; world <= 9; ++world) {
    std::set<std::pair<int, int>> met;
    for (int round = 0; round < detail::exchange_rounds(world); ++round) {
      for (int r = 0; r < world; ++r) {
        const int p = detail::exchange_partner(r, world, round);
        if (p < 0) continue;
        ASSERT_NE(p, r) << "world " << world << " round " << round;
        ASSERT_LT(p, world);
        ASSERT_EQ(detail::exchange_partner(p, world, round), r)
            << "world " << world << " round " << round << " rank " << r;
        if (r < p) {
          ASSERT_TRUE(met.insert({r, p}).second) << world << ": " << r << "-" << p;
        }
      }
    }
    EXPECT_EQ(met.size(), static_cast<size_t>(world * (world - 1) / 2)) << "world " << world;
  }
}

class QuantizedReduceScatterBound
    : public ::testing::TestWithParam<std::tuple<Quantization, int, int64_t>> {};

// Per element of rank r's chunk: |quantised - fp32| <= (1 / world) sum over the other ranks
// of their quantisation error bound (bf16 2^-8 |x|; int8 max|block| / 254, blocks starting at
// the chunk's start), plus fp32 round-off of the two sums.
TEST_P(QuantizedReduceScatterBound, MatchesFp32ReduceScatterWithinTheBound) {
  const auto [q, world, n] = GetParam();
  constexpr int64_t kBlock = 64;
  at::set_num_threads(1);
  torch::manual_seed(n * 7 + world);
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < world; ++r) {
    at::Tensor x =
        at::randn({n * world}) * at::pow(10.0, at::randint(-2, 3, {n * world}).to(at::kFloat));
    x.masked_fill_(at::rand({n * world}) < 0.1, 0.0);
    inputs.push_back(x);
  }
  // Rank 0's chunk is zero on every rank: its result must be exactly zero.
  for (auto& x : inputs) x.narrow(0, 0, n).zero_();
  std::vector<at::Tensor> quantised(world), exact(world);
  std::vector<int64_t> wire(world);
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    at::Tensor out = at::full({n}, 7.0f);
    detail::quantized_reduce_scatter(comm, out, inputs[r], q, kBlock, &wire[r])->wait();
    at::Tensor ref = at::empty({n});
    comm.reduce_scatter(ref, inputs[r].clone(), ReduceOp::kAvg)->wait();
    quantised[r] = out;
    exact[r] = ref;
  });
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  for (int r = 0; r < world; ++r) {
    at::Tensor bound = at::zeros({n}, at::kDouble);
    at::Tensor magnitude = at::zeros({n}, at::kDouble);
    for (int p = 0; p < world; ++p) {
      const at::Tensor x = inputs[p].narrow(0, r * n, n).abs().to(at::kDouble);
      magnitude += x;
      if (p == r) continue;  // the owner's own chunk is never quantised
      if (q == Quantization::kBf16) {
        bound += x * std::ldexp(1.0, -8);
      } else {
        at::Tensor padded = at::constant_pad_nd(x, {0, blocks * kBlock - n}, 0);
        bound += (padded.view({blocks, kBlock}).amax(1, true).expand({blocks, kBlock}) / 254.0)
                     .reshape({-1})
                     .narrow(0, 0, n);
      }
    }
    bound = bound / world + magnitude * (world * std::ldexp(1.0, -23)) + 1e-30;
    const at::Tensor err = (quantised[r].to(at::kDouble) - exact[r].to(at::kDouble)).abs();
    EXPECT_FALSE((err > bound).any().item<bool>())
        << "rank " << r << ": worst excess " << (err - bound).max().item<double>();
    if (r == 0) {
      EXPECT_TRUE(at::equal(quantised[0], at::zeros({n}))) << "zeros in, zeros out";
    }
    EXPECT_EQ(wire[r], world * detail::quantized_bytes(q, n, kBlock));
  }
  // The bound is not vacuous: the quantised result differs from the exact one somewhere.
  if (world > 1 && n > 1) {
    bool differs = false;
    for (int r = 1; r < world; ++r) differs = differs || !at::equal(quantised[r], exact[r]);
    EXPECT_TRUE(differs);
  }
}

INSTANTIATE_TEST_SUITE_P(
    DtypesRanksSizes, QuantizedReduceScatterBound,
    ::testing::Combine(::testing::Values(Quantization::kBf16, Quantization::kInt8),
                       ::testing::Values(2, 3, 4), ::testing::Values<int64_t>(1, 63, 1001)),
    [](const auto& info) {
      return fmt::format("{}_world{}_n{}", to_string(std::get<0>(info.param)),
                         std::get<1>(info.param), std::get<2>(info.param));
    });

TEST(QuantizedReduceScatter, RefusesMismatchedSizes) {
  run_ranks(2, [&](Communicator& comm) {
    bool threw = false;
    try {
      detail::quantized_reduce_scatter(comm, at::empty({3}), at::zeros({7}), Quantization::kInt8,
                                       64, nullptr);
    } catch (const InvalidArgument&) {
      threw = true;
    }
    DTRAIN_CHECK(threw, "a 7-element input for 2 x 3 outputs was accepted");
  });
}

// FSDP with int8 gradients trains a small regression about as far as fp32 gradients, on
// fewer bytes.
TEST(QuantizedReduceScatter, FsdpInt8TrainingConvergesLikeFp32) {
  at::set_num_threads(1);
  constexpr int kSteps = 60;
  constexpr int64_t kBatch = 16;
  torch::manual_seed(11);
  const at::Tensor teacher = at::randn({32, 8});
  std::vector<at::Tensor> xs;
  for (int s = 0; s < kSteps; ++s) xs.push_back(at::randn({kBatch * 4, 32}));
  struct Result {
    double first = 0, last = 0;
    int64_t bytes = 0;
  };
  auto train = [&](Quantization q, int world) {
    std::vector<std::shared_ptr<torch::nn::Module>> models;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(21);
      models.push_back(Mlp(32, 64, 8).ptr());
    }
    std::vector<Result> results(world);
    run_ranks(world, [&](Communicator& comm) {
      const int r = comm.rank();
      FsdpOptions o;
      o.quantize_grads = q;
      auto& mlp = static_cast<MlpImpl&>(*models[r]);
      FullyShardedDataParallel fsdp(models[r],
                                    std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
      torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      const int64_t local = kBatch * 4 / world;
      for (int s = 0; s < kSteps; ++s) {
        at::Tensor x = xs[s].narrow(0, r * local, local);
        opt.zero_grad();
        at::Tensor loss =
            fsdp.forward([&] { return at::mse_loss(mlp.forward(x), at::mm(x, teacher)); });
        fsdp.backward(loss);
        opt.step();
        if (s == 0) results[r].first = loss.item<double>();
        if (s == kSteps - 1) results[r].last = loss.item<double>();
      }
      results[r].bytes = fsdp.last_step_stats().bytes_communicated;
    });
    Result mean;
    for (const auto& res : results) {
      mean.first += res.first / world;
      mean.last += res.last / world;
    }
    mean.bytes = results[0].bytes;
    return mean;
  };
  for (int world : {2, 4}) {
    const Result fp32 = train(Quantization::kNone, world);
    const Result int8 = train(Quantization::kInt8, world);
    EXPECT_LT(fp32.last, 0.5 * fp32.first) << "world " << world;
    EXPECT_LT(int8.last, 0.5 * int8.first) << "world " << world;
    EXPECT_LT(std::abs(int8.last - fp32.last), 0.05 * fp32.last)
        << "world " << world << ": fp32 " << fp32.last << ", int8 " << int8.last;
    // The step's all-gathers stay fp32; its reduce-scatter shrinks to about a quarter.
    EXPECT_LT(int8.bytes, fp32.bytes) << "world " << world;
  }
}

}  // namespace
}  // namespace dtrain

// Quantised communication (dtrain/quantization.h): round trips within the stated bounds at
// every dtype and block size, odd sizes and zeros; the DataParallel hook against the exact
// average; training converges under it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "compress/quantize.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/quantization.h"
#include "dtrain/wire_stats.h"
#include "strategy/test_models.h"
#include "support/check.h"
#include "support/hosts.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

class QuantizeRoundTrip
    : public ::testing::TestWithParam<std::tuple<Quantization, int64_t, int64_t>> {};

TEST_P(QuantizeRoundTrip, ErrorWithinTheStatedBound) {
  const auto [q, block, numel] = GetParam();
  torch::manual_seed(numel * 31 + block);
  // Magnitudes over many octaves, exact zeros among them, and a run of zeros long enough to
  // fill whole blocks.
  at::Tensor x = at::randn({numel}) * at::pow(10.0, at::randint(-3, 4, {numel}).to(at::kFloat));
  x.masked_fill_(at::rand({numel}) < 0.1, 0.0);
  if (numel > 600) x.narrow(0, 100, 500).zero_();
  const int64_t bytes = detail::quantized_bytes(q, numel, block);
  ASSERT_EQ(bytes % 4, 0);
  at::Tensor wire = at::empty({bytes}, at::kByte);
  detail::quantize(x, wire, q, block);
  at::Tensor y = at::empty({numel});
  detail::dequantize(wire, y, q, block);
  at::Tensor err = (y - x).abs();
  at::Tensor bound;
  if (q == Quantization::kBf16) {
    bound = x.abs() * std::ldexp(1.0, -8);
  } else {
    // max |block| / 254 (int4: / 14), each element against its own block's largest magnitude.
    const int64_t blocks = (numel + block - 1) / block;
    at::Tensor padded = at::constant_pad_nd(x.abs(), {0, blocks * block - numel}, 0);
    at::Tensor amax = padded.view({blocks, block}).amax(1, true).expand({blocks, block});
    // Slack for fp32 round-off in x / scale and q * scale (a few ulps of 127).
    const double steps = q == Quantization::kInt8 ? 254.0 : 14.0;
    bound = amax.reshape({-1}).narrow(0, 0, numel) / steps * (1 + 1e-4);
  }
  const at::Tensor over = err > bound;
  EXPECT_FALSE(over.any().item<bool>()) << "worst excess " << (err - bound).max().item<double>()
                                        << " at " << (err - bound).argmax().item<int64_t>();
  // Zeros come back as zeros.
  EXPECT_TRUE(at::equal(y.masked_select(x == 0), at::zeros({(x == 0).sum().item<int64_t>()})));
  // Into another dtype: the same values, converted.
  at::Tensor y64 = at::empty({numel}, at::kDouble);
  detail::dequantize(wire, y64, q, block);
  EXPECT_TRUE(at::equal(y64.to(at::kFloat), y));
}

INSTANTIATE_TEST_SUITE_P(DtypesBlocksSizes, QuantizeRoundTrip,
                         ::testing::Combine(::testing::Values(Quantization::kBf16,
                                                              Quantization::kInt8,
                                                              Quantization::kInt4),
                                            ::testing::Values<int64_t>(1, 7, 64, 256, 4096),
                                            ::testing::Values<int64_t>(1, 3, 255, 257, 1000, 4099)),
                         [](const auto& info) {
                           return fmt::format("{}_block{}_n{}", to_string(std::get<0>(info.param)),
                                              std::get<1>(info.param), std::get<2>(info.param));
                         });

TEST(Quantize, AllZerosAndBadArguments) {
  at::Tensor zeros = at::zeros({300});
  for (auto q : {Quantization::kBf16, Quantization::kInt8, Quantization::kInt4}) {
    at::Tensor wire = at::empty({detail::quantized_bytes(q, 300, 64)}, at::kByte);
    detail::quantize(zeros, wire, q, 64);
    at::Tensor back = at::full({300}, 5.0f);
    detail::dequantize(wire, back, q, 64);
    EXPECT_TRUE(at::equal(back, zeros)) << to_string(q);
  }
  EXPECT_EQ(detail::quantized_bytes(Quantization::kInt8, 257, 256), 2 * 4 + 260);
  EXPECT_EQ(detail::quantized_bytes(Quantization::kBf16, 3, 256), 8);
  EXPECT_EQ(detail::quantized_bytes(Quantization::kInt4, 257, 256), 2 * 4 + 132);
  EXPECT_EQ(detail::quantized_bytes(Quantization::kInt4, 7, 256), 4 + 4);
  at::Tensor wire = at::empty({10}, at::kByte);
  EXPECT_THROW(detail::quantize(zeros, wire, Quantization::kInt8, 64), InvalidArgument);
  EXPECT_THROW(detail::quantize(zeros, at::empty({1216}, at::kByte), Quantization::kInt8, 0),
               InvalidArgument);
  EXPECT_THROW(detail::quantize(zeros, at::empty({1200}, at::kByte), Quantization::kNone, 64),
               InvalidArgument);
  EXPECT_THROW(quantized_allreduce_hook(Quantization::kInt8, 0), InvalidArgument);
}

class QuantizedHook : public ::testing::TestWithParam<std::tuple<Quantization, int>> {};

// Every rank gets the same result, within the bound of one quantisation per rank's input
// (averaged), and fp32 accumulation.
TEST_P(QuantizedHook, AveragesWithinTheBoundAndIdenticallyOnEveryRank) {
  const Quantization q = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  at::set_num_threads(1);
  constexpr int64_t kNumel = 1001, kBlock = 64;
  std::vector<at::Tensor> inputs, results(world);
  torch::manual_seed(9);
  for (int r = 0; r < world; ++r) inputs.push_back(at::randn({kNumel}));
  const at::Tensor exact = at::stack(inputs).mean(0);
  run_ranks(world, [&](Communicator& comm) {
    auto hook = quantized_allreduce_hook(q, kBlock);
    GradBucket b;
    b.buffer = inputs[comm.rank()].clone();
    b.parameters = {b.buffer};
    b.offsets = {0};
    b.is_last = true;
    hook->run(comm, b)->wait();
    results[comm.rank()] = b.buffer;
  });
  // bf16: 2^-8 of each input; int8: max|block| / 254 of each (int4: / 14), averaged over
  // ranks.
  double bound = 0;
  for (const auto& x : inputs) {
    const double steps = q == Quantization::kInt8 ? 254.0 : 14.0;
    bound += (q == Quantization::kBf16 ? x.abs().max().item<double>() * std::ldexp(1.0, -8)
                                       : x.abs().max().item<double>() / steps);
  }
  bound = bound / world + 1e-5;
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(at::equal(results[r], results[0])) << "rank " << r;
    EXPECT_LE((results[r] - exact).abs().max().item<double>(), bound) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, QuantizedHook,
                         ::testing::Combine(::testing::Values(Quantization::kBf16,
                                                              Quantization::kInt8,
                                                              Quantization::kInt4),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return fmt::format("{}_world{}", to_string(std::get<0>(info.param)),
                                              std::get<1>(info.param));
                         });

// The hook in two levels (a host group) over hosts of 2 and 3 ranks: every rank gets the
// same result, within two quantisations' bound (the other hosts' sums, averaged, then the
// average), on fewer inter-host bytes than the flat hook.
TEST(QuantizedHook, TwoLevelsOverHostsAverageWithinTheBoundIdentically) {
  at::set_num_threads(1);
  constexpr int64_t kNumel = 1001, kBlock = 64;
  for (auto [world, local] : {std::pair{4, 2}, std::pair{6, 3}, std::pair{6, 2}}) {
    for (Quantization q : {Quantization::kInt8, Quantization::kInt4, Quantization::kBf16}) {
      const std::string what = fmt::format("{} ranks, {} per host, {}", world, local, to_string(q));
      std::vector<at::Tensor> inputs, results(world), flat(world);
      std::vector<uint64_t> inter_two(world), inter_flat(world);
      torch::manual_seed(world * 10 + local);
      for (int r = 0; r < world; ++r) inputs.push_back(at::randn({kNumel}));
      const at::Tensor exact = at::stack(inputs).mean(0);
      std::vector<std::string> names;
      for (int r = 0; r < world; ++r) names.push_back(fmt::format("host{}", r / local));
      auto store = make_memory_store();
      run_threads(world, [&](int r) {
        CommunicatorPtr comm = make_host_communicator(store, r, names);
        CommunicatorPtr host = make_host_group(store, r, world, local);
        for (bool two_level : {true, false}) {
          auto hook = quantized_allreduce_hook(q, kBlock, two_level ? host : nullptr);
          GradBucket b;
          b.buffer = inputs[r].clone();
          b.parameters = {b.buffer};
          b.offsets = {0};
          b.is_last = true;
          const WireStats before = wire_stats(*comm);
          hook->run(*comm, b)->wait();
          const WireStats sent = wire_stats(*comm).since(before);
          (two_level ? inter_two : inter_flat)[r] = sent.total().inter_host;
          (two_level ? results : flat)[r] = b.buffer;
        }
      });
      const double steps = q == Quantization::kInt8 ? 254.0 : 14.0;
      const double hosts = world / local;
      double host_max = 0;
      for (int g = 0; g < hosts; ++g) {
        at::Tensor sum = at::zeros({kNumel});
        for (int i = 0; i < local; ++i) sum += inputs[g * local + i];
        host_max = std::max(host_max, sum.abs().max().item<double>());
      }
      const double avg_max = exact.abs().max().item<double>();
      // bf16's bound is relative per value; its largest-magnitude form is looser and valid.
      const double unit = q == Quantization::kBf16 ? std::ldexp(1.0, -8) : 1.0 / steps;
      const double bound =
          ((hosts - 1) / world * host_max + (avg_max + (hosts - 1) / world * host_max * unit)) *
              unit +
          1e-5;
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(at::equal(results[r], results[0])) << what << ": rank " << r;
        EXPECT_LE((results[r] - exact).abs().max().item<double>(), bound) << what;
      }
      uint64_t two = 0, all = 0;
      for (int r = 0; r < world; ++r) {
        two += inter_two[r];
        all += inter_flat[r];
      }
      // (Per rank the flat hook's all-gather crosses hosts from the host leaders only.)
      EXPECT_LT(two, all) << what << ": two-level " << two << ", flat " << all;
      EXPECT_FALSE(at::equal(results[0], exact)) << what << ": the bound is vacuous";
    }
  }
}

// DataParallel with int8 gradients trains a small regression about as far as fp32.
TEST(QuantizedHook, Int8TrainingConvergesLikeFp32) {
  at::set_num_threads(1);
  constexpr int kWorld = 2, kSteps = 60;
  constexpr int64_t kBatch = 16;
  torch::manual_seed(11);
  const at::Tensor teacher = at::randn({32, 8});
  std::vector<at::Tensor> xs;
  for (int s = 0; s < kSteps; ++s) xs.push_back(at::randn({kBatch * kWorld, 32}));
  auto final_loss = [&](Quantization q) {
    std::vector<std::shared_ptr<torch::nn::Module>> models;
    for (int r = 0; r < kWorld; ++r) {
      torch::manual_seed(21);
      models.push_back(Mlp(32, 64, 8).ptr());
    }
    std::vector<double> first(kWorld), last(kWorld);
    run_ranks(kWorld, [&](Communicator& comm) {
      const int r = comm.rank();
      DataParallelOptions o;
      o.comm_hook = quantized_allreduce_hook(q);
      auto& mlp = static_cast<MlpImpl&>(*models[r]);
      DataParallel ddp(models[r], std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
      torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      for (int s = 0; s < kSteps; ++s) {
        at::Tensor x = xs[s].narrow(0, r * kBatch, kBatch);
        opt.zero_grad();
        at::Tensor loss =
            ddp.forward([&] { return at::mse_loss(mlp.forward(x), at::mm(x, teacher)); });
        ddp.backward(loss);
        opt.step();
        if (s == 0) first[r] = loss.item<double>();
        if (s == kSteps - 1) last[r] = loss.item<double>();
      }
    });
    return std::make_pair((first[0] + first[1]) / 2, (last[0] + last[1]) / 2);
  };
  const auto fp32 = final_loss(Quantization::kNone);
  const auto int8 = final_loss(Quantization::kInt8);
  EXPECT_LT(fp32.second, 0.5 * fp32.first);
  EXPECT_LT(int8.second, 0.5 * int8.first);
  EXPECT_LT(std::abs(int8.second - fp32.second), 0.05 * fp32.second)
      << "fp32 " << fp32.second << ", int8 " << int8.second;
}

}  // namespace
}  // namespace dtrain

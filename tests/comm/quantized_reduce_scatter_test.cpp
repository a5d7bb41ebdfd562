// FSDP's quantised gradient reduce-scatter (FsdpOptions::quantize_grads): the exchange
// schedule, the result against Communicator::reduce_scatter in fp32 within the bound derived
// in compress/quantized_reduce_scatter.h (odd sizes, zeros, 2 to 6 ranks), flat and in two
// levels over hosts (threads claiming host identities), the two-level form's inter-host bytes,
// and FSDP training with int8 gradients against fp32.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <cmath>
#include <set>
#include <tuple>
#include <utility>

#include "compress/quantize.h"
#include "compress/quantized_reduce_scatter.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/quantization.h"
#include "dtrain/wire_stats.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/test_models.h"
#include "support/check.h"
#include "support/hosts.h"
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

// One quantisation's error bound per element of `x` (1-D, double): bf16 2^-8 |x|; int8
// max|block| / 254, int4 max|block| / 14, blocks of `block` starting at x's start.
at::Tensor quantisation_bound(const at::Tensor& x, Quantization q, int64_t block) {
  const int64_t n = x.numel();
  if (q == Quantization::kBf16) return x.abs() * std::ldexp(1.0, -8);
  const double steps = q == Quantization::kInt8 ? 254.0 : 14.0;
  const int64_t blocks = (n + block - 1) / block;
  at::Tensor padded = at::constant_pad_nd(x.abs(), {0, blocks * block - n}, 0);
  return (padded.view({blocks, block}).amax(1, true).expand({blocks, block}) / steps)
      .reshape({-1})
      .narrow(0, 0, n);
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
  for (int r = 0; r < world; ++r) {
    at::Tensor bound = at::zeros({n}, at::kDouble);
    at::Tensor magnitude = at::zeros({n}, at::kDouble);
    for (int p = 0; p < world; ++p) {
      const at::Tensor x = inputs[p].narrow(0, r * n, n).abs().to(at::kDouble);
      magnitude += x;
      if (p == r) continue;  // the owner's own chunk is never quantised
      bound += quantisation_bound(x, q, kBlock);
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

INSTANTIATE_TEST_SUITE_P(DtypesRanksSizes, QuantizedReduceScatterBound,
                         ::testing::Combine(::testing::Values(Quantization::kBf16,
                                                              Quantization::kInt8,
                                                              Quantization::kInt4),
                                            ::testing::Values(2, 3, 4),
                                            ::testing::Values<int64_t>(1, 63, 1001)),
                         [](const auto& info) {
                           return fmt::format("{}_world{}_n{}", to_string(std::get<0>(info.param)),
                                              std::get<1>(info.param), std::get<2>(info.param));
                         });

struct HostCase {
  Quantization q;
  int world, local;  // ranks, ranks per host
  int64_t n;         // values per rank's chunk
};

class HierarchicalReduceScatter : public ::testing::TestWithParam<HostCase> {};

// Two levels over hosts of `local` consecutive ranks (threads claiming host identities): the
// result against the fp32 reduce-scatter within (1 / world) sum over the other hosts of one
// quantisation of that host's sum, plus fp32 round-off; every value crosses hosts once, so
// the exchange's inter-host bytes are the flat exchange's divided by the ranks per host.
TEST_P(HierarchicalReduceScatter, MatchesFp32WithinTheBoundOnFewerInterHostBytes) {
  const HostCase c = GetParam();
  constexpr int64_t kBlock = 64;
  const int64_t n = c.n;
  const int hosts = c.world / c.local;
  at::set_num_threads(1);
  torch::manual_seed(n * 5 + c.world + c.local);
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < c.world; ++r) {
    at::Tensor x =
        at::randn({n * c.world}) * at::pow(10.0, at::randint(-2, 3, {n * c.world}).to(at::kFloat));
    x.masked_fill_(at::rand({n * c.world}) < 0.1, 0.0);
    x.narrow(0, 0, n).zero_();  // chunk 0 is zero everywhere: rank 0 must get exact zeros
    inputs.push_back(x);
  }
  std::vector<std::string> names;
  for (int r = 0; r < c.world; ++r) names.push_back(fmt::format("host{}", r / c.local));
  std::vector<at::Tensor> two_level(c.world), exact(c.world);
  std::vector<uint64_t> inter_two(c.world), inter_flat(c.world);
  auto store = make_memory_store();
  run_threads(c.world, [&](int r) {
    CommunicatorPtr comm = make_host_communicator(store, r, names);
    CommunicatorPtr host = make_host_group(store, r, c.world, c.local);
    detail::check_host_layout(*comm, *host);
    at::Tensor out = at::full({n}, 7.0f);
    WireStats before = wire_stats(*comm);
    detail::hierarchical_quantized_reduce_scatter(*comm, *host, out, inputs[r], c.q, kBlock,
                                                  nullptr)
        ->wait();
    inter_two[r] = wire_stats(*comm).since(before).point_to_point.inter_host;
    before = wire_stats(*comm);
    detail::quantized_reduce_scatter(*comm, at::empty({n}), inputs[r], c.q, kBlock, nullptr)
        ->wait();
    inter_flat[r] = wire_stats(*comm).since(before).point_to_point.inter_host;
    at::Tensor ref = at::empty({n});
    comm->reduce_scatter(ref, inputs[r].clone(), ReduceOp::kAvg)->wait();
    two_level[r] = out;
    exact[r] = ref;
  });
  for (int r = 0; r < c.world; ++r) {
    at::Tensor bound = at::zeros({n}, at::kDouble);
    at::Tensor magnitude = at::zeros({n}, at::kDouble);
    for (int g = 0; g < hosts; ++g) {
      at::Tensor host_sum = at::zeros({n});
      for (int i = 0; i < c.local; ++i) host_sum += inputs[g * c.local + i].narrow(0, r * n, n);
      for (int i = 0; i < c.local; ++i) {
        magnitude += inputs[g * c.local + i].narrow(0, r * n, n).abs().to(at::kDouble);
      }
      if (g == r / c.local) continue;  // the owner's host's sum is never quantised
      bound += quantisation_bound(host_sum.to(at::kDouble), c.q, kBlock);
    }
    bound = bound / c.world + magnitude * (2 * c.world * std::ldexp(1.0, -23)) + 1e-30;
    const at::Tensor err = (two_level[r].to(at::kDouble) - exact[r].to(at::kDouble)).abs();
    EXPECT_FALSE((err > bound).any().item<bool>())
        << "rank " << r << ": worst excess " << (err - bound).max().item<double>();
    if (r == 0) {
      EXPECT_TRUE(at::equal(two_level[0], at::zeros({n}))) << "zeros in, zeros out";
    }
    // Each rank sends its host's sums to the (hosts - 1) owners elsewhere, not every rank's
    // chunks to the (world - local) ranks elsewhere.
    EXPECT_EQ(inter_two[r] * c.local, inter_flat[r]) << "rank " << r;
    EXPECT_EQ(inter_two[r], (hosts - 1) * detail::quantized_bytes(c.q, n, kBlock)) << "rank " << r;
  }
  bool differs = false;
  for (int r = 0; r < c.world; ++r) differs = differs || !at::equal(two_level[r], exact[r]);
  EXPECT_TRUE(differs || hosts == 1 || n == 1) << "the bound is vacuous";
}

INSTANTIATE_TEST_SUITE_P(DtypesHostsSizes, HierarchicalReduceScatter,
                         ::testing::Values(HostCase{Quantization::kInt8, 4, 2, 1001},
                                           HostCase{Quantization::kInt8, 4, 2, 1},
                                           HostCase{Quantization::kInt4, 4, 2, 1001},
                                           HostCase{Quantization::kBf16, 4, 2, 63},
                                           HostCase{Quantization::kInt8, 6, 2, 63},
                                           HostCase{Quantization::kInt4, 6, 3, 1001},
                                           HostCase{Quantization::kInt8, 4, 4, 63}),
                         [](const auto& info) {
                           const HostCase& c = info.param;
                           return fmt::format("{}_world{}_local{}_n{}", to_string(c.q), c.world,
                                              c.local, c.n);
                         });

// A host group whose ranks are not consecutive ranks of the group reduced over (here the
// replicate groups {0, 2} and {1, 3}) is refused at construction on every rank.
TEST(HierarchicalReduceScatter, RefusesAHostGroupOfScatteredRanks) {
  at::set_num_threads(1);
  run_with_groups(4, 2, [&](Communicator& comm, const HybridGroups& g) {
    FsdpOptions o;
    o.quantize_grads = Quantization::kInt8;
    o.host_group = g.replicate_group;
    torch::manual_seed(3);
    auto model = Mlp(8, 16, 4).ptr();
    std::string message;
    try {
      FullyShardedDataParallel fsdp(model,
                                    std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
    DTRAIN_CHECK(message.find("must hold ranks") != std::string::npos,
                 "rank {}: scattered host group accepted or refused for another reason: '{}'",
                 comm.rank(), message);
  });
}

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

// One step per global batch of `xs` (rank r's 1/world of it) of the regression onto
// x -> x teacher under `fsdp`; the first and the last step's loss.
std::pair<double, double> train_regression(FullyShardedDataParallel& fsdp,
                                           torch::optim::Optimizer& opt, MlpImpl& mlp,
                                           const std::vector<at::Tensor>& xs,
                                           const at::Tensor& teacher, int r, int world) {
  double first = 0, last = 0;
  for (size_t s = 0; s < xs.size(); ++s) {
    const int64_t local = xs[s].size(0) / world;
    at::Tensor x = xs[s].narrow(0, r * local, local);
    opt.zero_grad();
    at::Tensor loss =
        fsdp.forward([&] { return at::mse_loss(mlp.forward(x), at::mm(x, teacher)); });
    fsdp.backward(loss);
    opt.step();
    if (s == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  return {first, last};
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
      std::tie(results[r].first, results[r].last) =
          train_regression(fsdp, opt, mlp, xs, teacher, r, world);
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

// FSDP over hosts A A B B with int8 and int4 gradients and a host group: the two-level
// reduce-scatter trains the regression as far as fp32 (and the flat int8 exchange), and its
// steps send fewer bytes across hosts (StepStats::wire, every communicator counted).
TEST(QuantizedReduceScatter, FsdpTwoLevelTrainsLikeFp32OnFewerInterHostBytes) {
  at::set_num_threads(1);
  constexpr int kSteps = 60, kWorld = 4;
  constexpr int64_t kBatch = 16;
  const std::vector<std::string> hosts = {"A", "A", "B", "B"};
  torch::manual_seed(11);
  const at::Tensor teacher = at::randn({32, 8});
  std::vector<at::Tensor> xs;
  for (int s = 0; s < kSteps; ++s) xs.push_back(at::randn({kBatch * 4, 32}));
  struct Result {
    double first = 0, last = 0;
    uint64_t inter_host = 0;  // the last step's, summed over ranks
  };
  auto train = [&](Quantization q, bool two_level) {
    std::vector<double> first(kWorld), last(kWorld);
    std::atomic<uint64_t> inter{0};
    // The models are made here, one after another: the threads share the global generator, so
    // seeding it inside them would race and give each run a different initialisation.
    std::vector<std::shared_ptr<torch::nn::Module>> models;
    for (int r = 0; r < kWorld; ++r) {
      torch::manual_seed(21);
      models.push_back(Mlp(32, 64, 8).ptr());
    }
    auto store = make_memory_store();
    run_threads(kWorld, [&](int r) {
      CommunicatorPtr world = make_host_communicator(store, r, hosts);
      auto model = models[r];
      auto& mlp = static_cast<MlpImpl&>(*model);
      FsdpOptions o;
      o.quantize_grads = q;
      if (two_level) o.host_group = make_host_group(store, r, kWorld, 2);
      FullyShardedDataParallel fsdp(model, world, o);
      torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      std::tie(first[r], last[r]) = train_regression(fsdp, opt, mlp, xs, teacher, r, kWorld);
      inter += fsdp.last_step_stats().wire.total().inter_host;
    });
    Result res;
    for (int r = 0; r < kWorld; ++r) {
      res.first += first[r] / kWorld;
      res.last += last[r] / kWorld;
    }
    res.inter_host = inter.load();
    return res;
  };
  const Result fp32 = train(Quantization::kNone, false);
  const Result flat = train(Quantization::kInt8, false);
  const Result int8 = train(Quantization::kInt8, true);
  const Result int4 = train(Quantization::kInt4, true);
  EXPECT_LT(fp32.last, 0.5 * fp32.first);
  EXPECT_LT(std::abs(int8.last - fp32.last), 0.05 * fp32.last)
      << "fp32 " << fp32.last << ", two-level int8 " << int8.last;
  EXPECT_LT(std::abs(int4.last - fp32.last), 0.1 * fp32.last)
      << "fp32 " << fp32.last << ", two-level int4 " << int4.last;
  EXPECT_LT(int8.inter_host, flat.inter_host);
  EXPECT_LT(int4.inter_host, int8.inter_host);
}

}  // namespace
}  // namespace dtrain

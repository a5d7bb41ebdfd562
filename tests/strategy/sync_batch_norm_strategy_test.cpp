// SyncBatchNorm under DataParallel and FullyShardedDataParallel: a small conv net with
// BatchNorm2d and BatchNorm1d, converted with convert_sync_batch_norm and trained by N ranks
// (threads, Gloo over loopback) on uneven slices of each global batch (one rank with a single
// row), must reach the parameters and running statistics of the unconverted net trained by
// SingleDevice on the whole batch, and evaluate like it. The SyncBatchNorm exchanges share
// the strategy's communicator.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dtrain/data_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "dtrain/sync_batch_norm.h"
#include "strategy/fsdp_ranks.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

constexpr int kSteps = 4;
// Rows of rank r: uneven, and a single row on rank 0 (BatchNorm1d sees one value per
// channel there: only the global batch has a variance).
const std::vector<int64_t> kRows = {1, 4, 2};

torch::nn::Sequential make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)),
                               torch::nn::BatchNorm2d(4), torch::nn::Tanh(), torch::nn::Flatten(),
                               torch::nn::Linear(4 * 4 * 4, 8),
                               torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(8).momentum(0.3)),
                               torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

struct Batch {
  at::Tensor x, y;
};

std::vector<Batch> make_batches(int64_t total) {
  torch::manual_seed(4321);
  std::vector<Batch> out;
  for (int s = 0; s < kSteps; ++s) {
    // Offset inputs: the statistics are far from BatchNorm's initial running ones.
    out.push_back({at::randn({total, 2, 4, 4}) * 1.5 + 0.5, at::randn({total, 3})});
  }
  return out;
}

// Each rank's loss is its rows' summed squared error scaled by world / global rows: the
// strategies average gradients over ranks, which then gives the global batch's mean loss,
// what the reference minimizes.
void train(Strategy& strategy, torch::nn::Module& net, const std::vector<Batch>& data, int64_t row0,
           int64_t rows, double scale) {
  torch::optim::SGD opt(strategy.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (const Batch& b : data) {
    opt.zero_grad();
    at::Tensor x = b.x.narrow(0, row0, rows), y = b.y.narrow(0, row0, rows);
    at::Tensor l = strategy.forward([&] {
      at::Tensor out = net.as<torch::nn::Sequential>()->forward(x);
      return (out - y).square().sum() * scale;
    });
    strategy.backward(l);
    opt.step();
  }
}

enum class Kind { kDdp, kFsdp };

class SyncBatchNormStrategies : public ::testing::TestWithParam<std::tuple<Kind, int>> {};

TEST_P(SyncBatchNormStrategies, MatchSingleDeviceBatchNormOnTheGlobalBatch) {
  const Kind kind = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  at::set_num_threads(1);
  std::vector<int64_t> rows(kRows.begin(), kRows.begin() + world), row0(world, 0);
  for (int r = 1; r < world; ++r) row0[r] = row0[r - 1] + rows[r - 1];
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  const auto data = make_batches(total);
  const at::Tensor eval_x = at::randn({total, 2, 4, 4}) - 0.5;

  torch::nn::Sequential ref = make_net(7);
  {
    SingleDevice single(ref.ptr());
    train(single, *ref, data, 0, total, 1.0 / static_cast<double>(total));
  }
  ref->eval();
  at::Tensor eval_want;
  {
    at::NoGradGuard no_grad;
    eval_want = ref->forward(eval_x);
  }

  // Rank 0 starts from the reference's weights; the strategies broadcast them.
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < world; ++r) nets.push_back(make_net(r == 0 ? 7 : 100 + r));

  run_with_groups(world, 0, [&](Communicator& comm, const HybridGroups&) {
    const int r = comm.rank();
    const CommunicatorPtr shared(&comm, [](Communicator*) {});
    torch::nn::Sequential& net = nets[r];
    convert_sync_batch_norm(net.ptr(), shared);
    DTRAIN_CHECK(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->ptr(1)) != nullptr &&
                     std::dynamic_pointer_cast<SyncBatchNormImpl>(net->ptr(5)) != nullptr,
                 "not converted");
    const double scale = static_cast<double>(world) / static_cast<double>(total);
    std::unique_ptr<Strategy> strategy;
    if (kind == Kind::kDdp) {
      strategy = std::make_unique<DataParallel>(net.ptr(), shared);
    } else {
      FsdpOptions o;
      // Every SyncBatchNorm and Linear its own unit: a SyncBatchNorm's weight is gathered
      // again for its backward, which reads it.
      o.wrap_policy = [](const std::string&, const torch::nn::Module& m) {
        return m.name().find("SyncBatchNorm") != std::string::npos ||
               m.name().find("Linear") != std::string::npos;
      };
      strategy = std::make_unique<FullyShardedDataParallel>(net.ptr(), shared, o);
    }
    train(*strategy, *net, data, row0[r], rows[r], scale);

    if (kind == Kind::kDdp) {
      for (const auto& item : ref->named_parameters()) {
        const at::Tensor got = net->named_parameters()[item.key()];
        DTRAIN_CHECK(at::allclose(got, item.value(), 1e-5, 1e-6),
                     "rank {} parameter {} differs from single-device BatchNorm: max |diff| {}", r,
                     item.key(), (got - item.value()).abs().max().item<double>());
      }
    } else {
      auto state = static_cast<FullyShardedDataParallel&>(*strategy).full_state_dict();
      if (r == 0) expect_state_matches(state, *ref, 1e-5, 1e-6);
    }
    // Running statistics: the global batch's, on every rank.
    for (const auto& item : ref->named_buffers()) {
      const at::Tensor got = net->named_buffers()[item.key()].to(at::kDouble);
      const at::Tensor want = item.value().to(at::kDouble);
      DTRAIN_CHECK(at::allclose(got, want, 1e-5, 1e-6),
                   "rank {} buffer {} differs from single-device BatchNorm: max |diff| {}", r,
                   item.key(), (got - want).abs().max().item<double>());
    }
    // Evaluation: the running statistics, no exchange of SyncBatchNorm's.
    net->eval();
    at::NoGradGuard no_grad;
    at::Tensor got =
        strategy->forward([&] { return net->forward(eval_x.narrow(0, row0[r], rows[r])); });
    const at::Tensor want = eval_want.narrow(0, row0[r], rows[r]);
    DTRAIN_CHECK(at::allclose(got, want, 1e-5, 1e-6),
                 "rank {} evaluation output differs from single-device BatchNorm: max |diff| {}", r,
                 (got - want).abs().max().item<double>());
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, SyncBatchNormStrategies,
                         ::testing::Combine(::testing::Values(Kind::kDdp, Kind::kFsdp),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == Kind::kDdp ? "ddp"
                                                                                    : "fsdp") +
                                  "_world" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace dtrain

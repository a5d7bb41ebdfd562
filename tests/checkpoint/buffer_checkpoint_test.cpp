// Buffers that differ between ranks (BatchNorm's running statistics: each rank updates them
// from its own rows) in checkpoints. The rule (docs/checkpoints.md, "Buffers"): the saved
// buffer is rank 0's whole copy, the one DataParallel broadcasts at every forward, never a
// stitch of several ranks' copies; where buffers are not broadcast (FSDP, DataParallel with
// broadcast_buffers = false) each rank's own copy also goes into the checkpoint's rank state,
// so that a resume at the same world size continues exactly. Checked against an
// uninterrupted run, in both forms.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using testing::run_ranks;

constexpr int kWorld = 2;
constexpr int kRowsPerRank = 4;
constexpr int kSaveAfter = 3;  // steps before the checkpoint
constexpr int kSteps = 6;

std::shared_ptr<torch::nn::SequentialImpl> make_bn_model(uint64_t seed) {
  torch::manual_seed(seed);
  auto seq =
      torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::BatchNorm1d(8),
                            torch::nn::Functional([](const at::Tensor& t) { return at::tanh(t); }),
                            torch::nn::Linear(8, 4));
  return seq.ptr();
}

// Every rank's rows differ, so do their batch statistics.
at::Tensor rows_of(int step, int rank, int64_t cols) {
  return at::randn({kRowsPerRank, cols}, at::TensorOptions().dtype(at::kFloat))
      .mul_(1 + step)
      .add_(rank * 0.5 + step * 0.1)
      .contiguous();
}

struct Batches {
  std::vector<std::vector<at::Tensor>> x, y;  // [step][rank]
};
Batches make_batches() {
  torch::manual_seed(2024);
  Batches b;
  for (int s = 0; s < kSteps; ++s) {
    b.x.emplace_back();
    b.y.emplace_back();
    for (int r = 0; r < kWorld; ++r) {
      b.x[s].push_back(rows_of(s, r, 6));
      b.y[s].push_back(rows_of(s, r, 4));
    }
  }
  return b;
}

using Buffers = std::map<std::string, at::Tensor>;
Buffers buffers_of(const torch::nn::Module& m) {
  Buffers out;
  for (const auto& item : m.named_buffers(true)) out[item.key()] = item.value().clone();
  return out;
}

struct BufferCase {
  std::string name;
  std::string strategy;  // ddp | fsdp
  bool broadcast_buffers = true;
  CheckpointFormat format = CheckpointFormat::kSharded;
};
void PrintTo(const BufferCase& c, std::ostream* os) { *os << c.name; }

std::shared_ptr<Strategy> make_strategy(const BufferCase& s, std::shared_ptr<torch::nn::Module> m,
                                        Communicator& comm) {
  auto c = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
  if (s.strategy == "ddp") {
    DataParallelOptions o;
    o.broadcast_buffers = s.broadcast_buffers;
    return std::make_shared<DataParallel>(std::move(m), c, o);
  }
  return std::make_shared<FullyShardedDataParallel>(std::move(m), c);
}

void step(Strategy& strategy, torch::nn::SequentialImpl& seq, torch::optim::Optimizer& opt,
          const Batches& b, int s, int rank) {
  opt.zero_grad();
  at::Tensor loss =
      strategy.forward([&] { return at::mse_loss(seq.forward(b.x[s][rank]), b.y[s][rank]); });
  strategy.backward(loss);
  opt.step();
}

class BufferCheckpoint : public ::testing::TestWithParam<BufferCase> {};

TEST_P(BufferCheckpoint, HoldsRankZerosCopyAndResumesEveryRanksStatisticsExactly) {
  const BufferCase setup = GetParam();
  at::set_num_threads(1);
  const Batches batches = make_batches();
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("dtrain_buffer_ckpt_" + setup.name + "_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);

  // Uninterrupted run, saving after kSaveAfter steps.
  std::vector<std::shared_ptr<torch::nn::SequentialImpl>> models;
  for (int r = 0; r < kWorld; ++r) models.push_back(make_bn_model(7));
  std::vector<Buffers> at_save(kWorld), final_buffers(kWorld);
  run_ranks(kWorld, [&](Communicator& comm) {
    const int r = comm.rank();
    auto strategy = make_strategy(setup, models[r], comm);
    torch::optim::SGD opt(strategy->parameters(), torch::optim::SGDOptions(0.05));
    for (int s = 0; s < kSteps; ++s) {
      if (s == kSaveAfter) {
        at_save[r] = buffers_of(*models[r]);
        CheckpointOptions o;
        o.format = setup.format;
        TrainingState state;
        state.step = s;
        save_checkpoint(dir, *strategy, &opt, state, o);
      }
      step(*strategy, *models[r], opt, batches, s, r);
    }
    final_buffers[r] = buffers_of(*models[r]);
  });
  // The ranks' statistics really differ, or the test would prove nothing.
  DTRAIN_CHECK(!at::equal(at_save[0].at("1.running_mean"), at_save[1].at("1.running_mean")),
               "the ranks' running means are equal: the test's data do not exercise the rule");

  const std::string path = latest_checkpoint(dir);
  DTRAIN_CHECK(!path.empty(), "no checkpoint in {}", dir);

  // The saved buffers are rank 0's whole copies, read as a single-device user would.
  {
    auto single_model = make_bn_model(11);
    SingleDevice single(single_model);
    load_checkpoint(path, single, nullptr);
    for (const auto& [name, saved] : buffers_of(*single_model)) {
      DTRAIN_CHECK(
          at::equal(saved, at_save[0].at(name)),
          "{}: the checkpoint's '{}' is not rank 0's copy (max |diff| {})", setup.name, name,
          (saved.to(at::kDouble) - at_save[0].at(name).to(at::kDouble)).abs().max().item<double>());
    }
  }

  // Resumed at the same world size: every rank's statistics continue as if uninterrupted.
  std::vector<std::shared_ptr<torch::nn::SequentialImpl>> resumed;
  for (int r = 0; r < kWorld; ++r) resumed.push_back(make_bn_model(100 + r));
  run_ranks(kWorld, [&](Communicator& comm) {
    const int r = comm.rank();
    auto strategy = make_strategy(setup, resumed[r], comm);
    torch::optim::SGD opt(strategy->parameters(), torch::optim::SGDOptions(0.05));
    const TrainingState state = load_checkpoint(path, *strategy, &opt);
    for (int s = static_cast<int>(state.step); s < kSteps; ++s) {
      step(*strategy, *resumed[r], opt, batches, s, r);
    }
    for (const auto& [name, got] : buffers_of(*resumed[r])) {
      const at::Tensor& want = final_buffers[r].at(name);
      DTRAIN_CHECK(at::equal(got, want),
                   "{}: rank {} buffer '{}' after resuming differs from the uninterrupted run "
                   "(max |diff| {})",
                   setup.name, r, name,
                   (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>());
    }
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, BufferCheckpoint,
    ::testing::Values(BufferCase{"ddp_sharded", "ddp", true, CheckpointFormat::kSharded},
                      BufferCase{"ddp_full", "ddp", true, CheckpointFormat::kFull},
                      BufferCase{"ddp_no_broadcast_sharded", "ddp", false,
                                 CheckpointFormat::kSharded},
                      BufferCase{"fsdp_sharded", "fsdp", true, CheckpointFormat::kSharded},
                      BufferCase{"fsdp_full", "fsdp", true, CheckpointFormat::kFull}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dtrain

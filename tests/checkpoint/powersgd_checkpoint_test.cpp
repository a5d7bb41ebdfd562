// PowerSGD's state in checkpoints (StateLayout::rank_state): a DataParallel run with
// powersgd_hook saved after N steps and resumed in fresh objects continues bit for bit like the
// uninterrupted run (fp32, 2 ranks), in both checkpoint forms; without the restored state it
// does not (the test can fail). Also the per-rank state's wire format.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint/rank_state.h"
#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/powersgd.h"
#include "strategy/test_models.h"
#include "support/check.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

constexpr int kWorld = 2, kSteps = 9, kSaveAt = 5;
constexpr int64_t kBatch = 8;

struct Data {
  at::Tensor teacher;
  std::vector<at::Tensor> xs;
};

Data make_data() {
  torch::manual_seed(11);
  Data d;
  d.teacher = at::randn({32, 8});
  for (int s = 0; s < kSteps; ++s) d.xs.push_back(at::randn({kBatch * kWorld, 32}));
  return d;
}

PowerSgdOptions psgd_options() {
  PowerSgdOptions p;
  p.rank = 2;
  p.start_iter = 2;
  p.seed = 5;
  return p;
}

enum class Resume { kNone, kRestored, kHookStateDropped };

// Trains steps [0, kSteps) on every rank; with a resume, steps [0, kSaveAt) are trained and
// saved, then fresh model, hook, DataParallel and optimizer load the checkpoint and train
// the rest. Returns rank r's final parameters.
std::vector<std::vector<at::Tensor>> run(const Data& d, Resume resume, CheckpointFormat format) {
  at::set_num_threads(1);
  TempDir dir("psgd_ckpt");
  std::vector<std::vector<at::Tensor>> out(kWorld);
  // The ranks are threads and LibTorch's default generator is one per process: a seeded
  // construction must not interleave with the other rank's, or the initial values vary.
  std::mutex init_mu;
  run_ranks(kWorld, [&](Communicator& comm) {
    const int r = comm.rank();
    auto shared = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    struct Run {
      std::shared_ptr<torch::nn::Module> model;
      std::shared_ptr<PowerSgdHook> hook;
      std::unique_ptr<DataParallel> ddp;
      std::unique_ptr<torch::optim::SGD> opt;
    };
    auto start = [&](uint64_t init_seed) {
      Run x;
      {
        std::lock_guard<std::mutex> lock(init_mu);
        torch::manual_seed(init_seed);
        x.model = Mlp(32, 64, 8).ptr();
      }
      x.hook = powersgd_hook(psgd_options());
      DataParallelOptions o;
      o.comm_hook = x.hook;
      x.ddp = std::make_unique<DataParallel>(x.model, shared, o);
      x.opt = std::make_unique<torch::optim::SGD>(x.ddp->parameters(),
                                                  torch::optim::SGDOptions(0.05).momentum(0.9));
      return x;
    };
    auto step = [&](Run& x, int s) {
      at::Tensor in = d.xs[s].narrow(0, r * kBatch, kBatch);
      auto& mlp = static_cast<MlpImpl&>(*x.model);
      x.opt->zero_grad();
      at::Tensor loss =
          x.ddp->forward([&] { return at::mse_loss(mlp.forward(in), at::mm(in, d.teacher)); });
      x.ddp->backward(loss);
      x.opt->step();
    };
    Run x = start(21);
    const int first_part = resume == Resume::kNone ? kSteps : kSaveAt;
    for (int s = 0; s < first_part; ++s) step(x, s);
    if (resume != Resume::kNone) {
      CheckpointOptions co;
      co.format = format;
      TrainingState st;
      st.step = kSaveAt;
      save_checkpoint(dir.path().string(), *x.ddp, x.opt.get(), st, co);
      x = start(99);  // other initial values: everything must come from the checkpoint
      const TrainingState loaded =
          load_checkpoint(latest_checkpoint(dir.path().string()), *x.ddp, x.opt.get());
      DTRAIN_CHECK(loaded.step == kSaveAt, "step {}", loaded.step);
      DTRAIN_CHECK(x.hook->iteration() == kSaveAt, "hook iteration {} after the load",
                   x.hook->iteration());
      if (resume == Resume::kHookStateDropped) {
        // Only the step counter: error feedback and the warm start's Q start over.
        x.hook->load_state({{"iteration", at::full({1}, int64_t{kSaveAt}, at::kLong)}});
      }
      for (int s = kSaveAt; s < kSteps; ++s) step(x, s);
    }
    for (const auto& p : x.model->parameters()) out[r].push_back(p.detach().clone());
  });
  return out;
}

bool identical(const std::vector<std::vector<at::Tensor>>& a,
               const std::vector<std::vector<at::Tensor>>& b) {
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < a[r].size(); ++i) {
      if (!at::equal(a[r][i], b[r][i])) return false;
    }
  }
  return true;
}

TEST(PowerSgdCheckpoint, ResumedRunContinuesBitForBit) {
  const Data d = make_data();
  const auto uninterrupted = run(d, Resume::kNone, CheckpointFormat::kSharded);
  for (CheckpointFormat f : {CheckpointFormat::kSharded, CheckpointFormat::kFull}) {
    const auto resumed = run(d, Resume::kRestored, f);
    EXPECT_TRUE(identical(uninterrupted, resumed))
        << (f == CheckpointFormat::kFull ? "full" : "sharded") << " form";
  }
  // What the checkpoint's hook state buys: without it the run goes elsewhere.
  const auto dropped = run(d, Resume::kHookStateDropped, CheckpointFormat::kSharded);
  EXPECT_FALSE(identical(uninterrupted, dropped));
}

TEST(PowerSgdCheckpoint, RankStateWireFormatRoundTrips) {
  std::map<std::string, at::Tensor> state = {
      {"a", at::arange(5, at::kLong)},
      {"hook/powersgd/bucket.0.error", at::randn({7})},
      {"m", at::randn({2, 3}).to(at::kDouble)},
      {"empty", at::empty({0})},
  };
  const auto back = checkpoint::unpack_rank_state(checkpoint::pack_rank_state(state));
  ASSERT_EQ(back.size(), state.size());
  for (const auto& [name, t] : state) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_TRUE(at::equal(back.at(name), t)) << name;
    EXPECT_EQ(back.at(name).scalar_type(), t.scalar_type()) << name;
  }
  std::string cut = checkpoint::pack_rank_state(state);
  cut.resize(cut.size() - 3);
  EXPECT_THROW(checkpoint::unpack_rank_state(cut), CheckpointError);
}

}  // namespace
}  // namespace dtrain

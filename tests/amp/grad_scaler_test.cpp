// GradScaler: unscaling, skipping and the scale's backoff and growth on one rank; its state
// machine and state dict; and as separate processes under DataParallel and FSDP, an
// overflow only one rank sees makes every rank skip that step and halve the scale, with
// identical scaler state on every rank.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/grad_scaler.h"
#include "support/ranks.h"
#include "worker/amp_scenarios.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// One parameter [4] with gradient `grad`, stepped by plain SGD (lr 1).
struct OneParam {
  at::Tensor p = at::ones({4}).requires_grad_(true);
  torch::optim::SGD opt{std::vector<at::Tensor>{p}, torch::optim::SGDOptions(1.0)};
  void set_grad(const at::Tensor& g) { p.mutable_grad() = g.clone(); }
};

TEST(GradScaler, UnscalesThenStepsWithTheTrueGradient) {
  GradScalerOptions o;
  o.init_scale = 8;
  GradScaler scaler(nullptr, o);
  EXPECT_EQ(scaler.scale(at::full({}, 0.5)).item<double>(), 4.0);
  OneParam m;
  m.set_grad(at::full({4}, 8.0f));  // what backward of the scaled loss gives for grad 1
  EXPECT_FALSE(scaler.unscale(m.opt));
  EXPECT_TRUE(at::equal(m.p.grad(), at::ones({4})));
  EXPECT_TRUE(scaler.step(m.opt));
  EXPECT_TRUE(at::equal(m.p.detach(), at::zeros({4})));
  scaler.update();
  EXPECT_EQ(scaler.state().growth_tracker, 1);
  EXPECT_EQ(scaler.current_scale(), 8);
}

TEST(GradScaler, InfOrNanSkipsTheStepAndHalvesTheScale) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    GradScaler scaler;
    OneParam m;
    at::Tensor g = at::ones({4});
    g[2] = bad;
    m.set_grad(g);
    EXPECT_FALSE(scaler.step(m.opt)) << bad;  // step() unscales first
    EXPECT_TRUE(scaler.found_inf());
    EXPECT_TRUE(at::equal(m.p.detach(), at::ones({4}))) << "the parameter moved";
    scaler.update();
    EXPECT_EQ(scaler.current_scale(), 32768);
    EXPECT_EQ(scaler.state().skipped_steps, 1);
    EXPECT_EQ(scaler.state().growth_tracker, 0);
  }
}

TEST(GradScaler, GrowsAfterTheIntervalOfCleanSteps) {
  GradScalerOptions o;
  o.init_scale = 4;
  o.growth_interval = 3;
  GradScaler scaler(nullptr, o);
  OneParam m;
  std::vector<double> scales;
  for (int s = 0; s < 7; ++s) {
    m.set_grad(at::ones({4}));
    scaler.step(m.opt);
    scaler.update();
    scales.push_back(scaler.current_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{4, 4, 8, 8, 8, 16, 16}));
}

TEST(GradScaler, FixedScaleSkipsButNeverChanges) {
  GradScalerOptions o;
  o.init_scale = 128;
  o.dynamic = false;
  o.growth_interval = 1;
  GradScaler scaler(nullptr, o);
  OneParam m;
  for (int s = 0; s < 3; ++s) {
    at::Tensor g = at::ones({4});
    if (s == 1) g[0] = std::numeric_limits<float>::infinity();
    m.set_grad(g);
    EXPECT_EQ(scaler.step(m.opt), s != 1);
    scaler.update();
    EXPECT_EQ(scaler.current_scale(), 128);
  }
  EXPECT_EQ(scaler.state().skipped_steps, 1);
}

TEST(GradScaler, CallsOutOfOrderAreNamed) {
  GradScaler scaler;
  OneParam m;
  m.set_grad(at::ones({4}));
  try {
    scaler.update();
    FAIL() << "update() before step() was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("GradScaler.update()"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("called in stage idle (before unscale), needs stage "
                                         "stepped (before update)"),
              std::string::npos)
        << e.what();
  }
  scaler.unscale(m.opt);
  EXPECT_THROW(scaler.unscale(m.opt), InvalidArgument);  // twice would divide twice
  scaler.step(m.opt);
  EXPECT_THROW(scaler.step(m.opt), InvalidArgument);
  scaler.update();
  EXPECT_NO_THROW(scaler.step(m.opt));
}

TEST(GradScaler, StateDictRoundTripsExactly) {
  GradScalerOptions o;
  o.init_scale = 3.0e-5;  // not a power of two: printed exactly all the same
  GradScaler a(nullptr, o);
  OneParam m;
  m.set_grad(at::ones({4}));
  a.step(m.opt);
  a.update();
  GradScaler b;
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.current_scale(), a.current_scale());
  EXPECT_EQ(b.state().growth_tracker, 1);
  auto values = a.state_dict();
  values.erase("grad_scaler.growth_tracker");
  EXPECT_THROW(b.load_state_dict(values), InvalidArgument);
  values = a.state_dict();
  values["grad_scaler.scale"] = "-1";
  EXPECT_THROW(b.load_state_dict(values), InvalidArgument);
  GradScalerOptions bad;
  bad.backoff_factor = 1.5;
  EXPECT_THROW(GradScaler(nullptr, bad), InvalidArgument);
}

// ---- As processes: every rank skips the step one rank found an overflow in ----

struct ScalerLine {
  int step;
  double scale;
  long tracker, skipped;
  int found_inf, stepped;
  double param_sum;
};

std::vector<ScalerLine> read_lines(const std::string& path) {
  std::vector<ScalerLine> out;
  std::ifstream in(path);
  ScalerLine l{};
  while (in >> l.step >> l.scale >> l.tracker >> l.skipped >> l.found_inf >> l.stepped >>
         l.param_sum) {
    out.push_back(l);
  }
  return out;
}

class GradScalerProcesses : public ::testing::TestWithParam<std::string> {};

TEST_P(GradScalerProcesses, OverflowOnOneRankSkipsTheStepOnEveryRank) {
  const int world = 2;
  const int port = free_port();
  const std::string out =
      ::testing::TempDir() + "dtrain_scaler_" + GetParam() + "_" + std::to_string(port);
  std::vector<Process> ps;
  for (int r = 0; r < world; ++r) {
    ps.push_back(spawn_process({DTRAIN_TEST_WORKER, "grad_scaler_" + GetParam(), "60000", out},
                               rank_env(r, world, port)));
  }
  for (int r = 0; r < world; ++r) {
    auto res = wait_process(ps[r], 120);
    ASSERT_EQ(res.exit_code, 0) << "rank " << r << ":\n" << res.output;
  }
  std::vector<std::vector<ScalerLine>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(read_lines(out + "." + std::to_string(r)));
    std::remove((out + "." + std::to_string(r)).c_str());
    ASSERT_EQ(ranks[r].size(), static_cast<size_t>(kScalerSteps)) << "rank " << r;
  }
  // init 1024, growth interval 2: grow after steps 1 and 4; the overflow (step 2) halves.
  const std::vector<double> scales = {1024, 2048, 1024, 1024, 2048, 2048};
  for (int s = 0; s < kScalerSteps; ++s) {
    const bool overflow = s == kOverflowStep;
    for (int r = 0; r < world; ++r) {
      const ScalerLine& l = ranks[r][s];
      EXPECT_EQ(l.found_inf, overflow ? 1 : 0) << "rank " << r << " step " << s;
      EXPECT_EQ(l.stepped, overflow ? 0 : 1) << "rank " << r << " step " << s;
      EXPECT_EQ(l.scale, scales[s]) << "rank " << r << " step " << s;
      EXPECT_EQ(l.skipped, s >= kOverflowStep ? 1 : 0) << "rank " << r << " step " << s;
      // The same scaler state everywhere.
      EXPECT_EQ(l.tracker, ranks[0][s].tracker) << "rank " << r << " step " << s;
      // A skipped step leaves the parameters as they were; every other step moves them.
      if (s > 0) {
        if (overflow) {
          EXPECT_EQ(l.param_sum, ranks[r][s - 1].param_sum) << "rank " << r;
        } else {
          EXPECT_NE(l.param_sum, ranks[r][s - 1].param_sum) << "rank " << r << " step " << s;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, GradScalerProcesses, ::testing::Values("ddp", "fsdp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dtrain

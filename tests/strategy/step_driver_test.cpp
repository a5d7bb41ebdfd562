// The step driver (src/strategy/step_driver.h): the one step protocol SingleDevice,
// DataParallel and FSDP run. A scripted participant shows the order of its calls, the state
// transitions, the failure policy (agreed failure: reset and usable; StepBreak or an
// out-of-step report from another thread: broken for good) and the stats; then the strategies
// show the same contract through their public API.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/linear.h>

#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "strategy/step_driver.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using testing::run_ranks;

// Records every call; run_backward does what `backward_does` says.
struct Scripted final : StepParticipant {
  enum class Backward { kSucceed, kFail, kBreak, kOutOfStepFromAnotherThread };
  Backward backward_does = Backward::kSucceed;
  StepFailure* failure = nullptr;
  std::vector<std::string> calls;
  int64_t bytes = 0;

  void start_forward(bool training, bool sync) override {
    calls.push_back(std::string("start_forward ") + (training ? "train" : "eval") +
                    (sync ? "" : " no_sync"));
  }
  void end_forward(bool training) override {
    calls.push_back(std::string("end_forward ") + (training ? "train" : "eval"));
  }
  void issue_as_peers_do(bool training, bool sync) override {
    calls.push_back(std::string("issue_as_peers_do ") + (training ? "train" : "eval") +
                    (sync ? "" : " no_sync"));
  }
  std::exception_ptr run_backward(const at::Tensor&, bool) override {
    calls.push_back("run_backward");
    bytes += 100;
    switch (backward_does) {
      case Backward::kSucceed:
        return nullptr;
      case Backward::kFail:
        return std::make_exception_ptr(std::runtime_error("autograd failed here"));
      case Backward::kBreak:
        try {
          throw std::runtime_error("the collective timed out");
        } catch (...) {
          break_step("a gradient collective failed");
        }
      case Backward::kOutOfStepFromAnotherThread: {
        std::thread hook([this] {
          failure->out_of_step(std::make_exception_ptr(std::runtime_error("hook threw")));
        });
        hook.join();
        return nullptr;
      }
    }
    return nullptr;
  }
  void commit_backward(bool) override { calls.push_back("commit_backward"); }
  void reset_after_failure(bool training) noexcept override {
    calls.push_back(std::string("reset_after_failure ") + (training ? "train" : "eval"));
  }
  StepStats step_counters() const override {
    StepStats s;
    s.bytes_communicated = bytes;
    return s;
  }
};

struct DriverFixture {
  Scripted p;
  StepDriver driver{"Scripted", nullptr, StepChecks::kAuto, {}, p};
  DriverFixture() { p.failure = &driver.failure(); }
};

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(StepDriver, RunsATrainingStepThroughEveryStateInOrder) {
  DriverFixture f;
  EXPECT_EQ(f.driver.state(), StepDriver::State::kIdle);
  f.driver.begin_forward(/*gradient_sync=*/true);
  EXPECT_EQ(f.driver.state(), StepDriver::State::kTraining);
  f.driver.end_forward();
  EXPECT_EQ(f.driver.state(), StepDriver::State::kAwaitingBackward);
  f.driver.backward(at::zeros({}), true);
  EXPECT_EQ(f.driver.state(), StepDriver::State::kIdle);
  EXPECT_EQ(f.p.calls, (std::vector<std::string>{"start_forward train", "end_forward train",
                                                 "run_backward", "commit_backward"}));
  EXPECT_EQ(f.driver.last_stats().bytes_communicated, 100);
  EXPECT_EQ(f.driver.step(), 0);
  f.driver.finish();
}

TEST(StepDriver, AnEvaluationLeavesTheLastTrainingStepsStats) {
  DriverFixture f;
  f.driver.begin_forward(true);
  f.driver.end_forward();
  f.driver.backward(at::zeros({}), true);
  f.p.bytes = 12345;  // what an evaluation's gathers would add
  {
    at::NoGradGuard no_grad;
    f.driver.begin_forward(true);
    EXPECT_EQ(f.driver.state(), StepDriver::State::kEvaluating);
    f.driver.end_forward();
  }
  EXPECT_EQ(f.driver.state(), StepDriver::State::kIdle);
  EXPECT_EQ(f.driver.last_stats().bytes_communicated, 100);
  EXPECT_EQ(f.p.calls.back(), "end_forward eval");
}

TEST(StepDriver, AnAgreedFailureResetsAndTheNextStepRuns) {
  DriverFixture f;
  f.p.backward_does = Scripted::Backward::kFail;
  f.driver.begin_forward(true);
  f.driver.end_forward();
  EXPECT_EQ(message_of([&] { f.driver.backward(at::zeros({}), true); }), "autograd failed here");
  EXPECT_EQ(f.p.calls.back(), "reset_after_failure train");
  EXPECT_EQ(f.driver.failure().state(), StepFailure::State::kHealthy);
  f.p.backward_does = Scripted::Backward::kSucceed;
  f.driver.begin_forward(true);
  f.driver.end_forward();
  f.driver.backward(at::zeros({}), true);
  EXPECT_EQ(f.p.calls.back(), "commit_backward");
}

TEST(StepDriver, AFailedForwardIssuesWhatPeersDoThenResets) {
  DriverFixture f;
  f.driver.begin_forward(/*gradient_sync=*/false);
  f.driver.forward_failed(std::make_exception_ptr(std::runtime_error("model threw")));
  EXPECT_EQ(f.driver.state(), StepDriver::State::kIdle);
  EXPECT_EQ(f.p.calls, (std::vector<std::string>{"start_forward train no_sync",
                                                 "issue_as_peers_do train no_sync",
                                                 "reset_after_failure train"}));
  f.driver.begin_forward(true);  // usable
}

TEST(StepDriver, AStepBreakBreaksForGoodNamingWhyAndCause) {
  DriverFixture f;
  f.p.backward_does = Scripted::Backward::kBreak;
  f.driver.begin_forward(true);
  f.driver.end_forward();
  const std::string first = message_of([&] { f.driver.backward(at::zeros({}), true); });
  EXPECT_NE(first.find("Scripted is unusable since step 0: a gradient collective failed: the "
                       "collective timed out"),
            std::string::npos)
      << first;
  EXPECT_EQ(f.driver.failure().state(), StepFailure::State::kBroken);
  EXPECT_EQ(message_of([&] { f.driver.begin_forward(true); }), first);
  EXPECT_EQ(message_of([&] { f.driver.finish(); }), first);
  EXPECT_EQ(f.p.calls.back(), "run_backward") << "a broken step resets nothing";
}

TEST(StepDriver, OutOfStepReportedOnAnotherThreadBreaksAtTheNextCheck) {
  DriverFixture f;
  f.p.backward_does = Scripted::Backward::kOutOfStepFromAnotherThread;
  f.driver.begin_forward(true);
  f.driver.end_forward();
  const std::string message = message_of([&] { f.driver.backward(at::zeros({}), true); });
  EXPECT_NE(message.find("may no longer match the other ranks': hook threw"), std::string::npos)
      << message;
  EXPECT_TRUE(f.driver.failure().broken());
}

// Identity forward; backward throws.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 const torch::autograd::variable_list&) {
    throw std::runtime_error("injected failure in backward");
  }
};

// SingleDevice runs the driver too: a failed backward drops the step's gradients (as DDP and
// FSDP do), rethrows, and the next step trains as if the failed one had not happened.
TEST(SingleDeviceSteps, AFailedBackwardDropsTheStepsGradientsAndTheNextStepRuns) {
  torch::manual_seed(5);
  auto model = torch::nn::Linear(4, 3);
  SingleDevice single(model.ptr());
  const at::Tensor x = at::randn({6, 4});
  // A first micro-batch accumulated without error, then one whose backward throws.
  single.backward(single.forward([&] { return model->forward(x).square().mean(); }));
  const std::string message = message_of([&] {
    single.backward(
        single.forward([&] { return ThrowInBackward::apply(model->forward(x)).square().mean(); }));
  });
  EXPECT_EQ(message, "injected failure in backward");
  for (const auto& p : single.parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0) << "the failed step's gradients stay";
  }
  single.backward(single.forward([&] { return model->forward(x).square().mean(); }));
  auto reference = torch::nn::Linear(4, 3);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < reference->parameters().size(); ++i) {
      reference->parameters()[i].copy_(model->parameters()[i]);
    }
  }
  reference->forward(x).square().mean().backward();
  for (size_t i = 0; i < reference->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(model->parameters()[i].grad(), reference->parameters()[i].grad()));
  }
  single.finish();
}

// Every strategy keeps the last training step's stats through an evaluation forward (FSDP
// reported its evaluation gathers as a step before the driver).
TEST(FsdpSteps, AnEvaluationForwardLeavesTheLastTrainingStepsStats) {
  run_ranks(2, [](Communicator& comm) {
    torch::manual_seed(7);
    auto model = torch::nn::Linear(8, 8);
    FullyShardedDataParallel fsdp(model.ptr(),
                                  std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    const at::Tensor x = at::randn({4, 8});
    fsdp.backward(fsdp.forward([&] { return model->forward(x).square().mean(); }));
    const StepStats trained = fsdp.last_step_stats();
    ASSERT_GT(trained.bytes_communicated, 0);
    {
      at::NoGradGuard no_grad;
      fsdp.forward([&] { return model->forward(x).sum(); });
    }
    EXPECT_EQ(fsdp.last_step_stats().bytes_communicated, trained.bytes_communicated);
    EXPECT_EQ(fsdp.last_step_stats().num_collectives, trained.num_collectives);
    EXPECT_EQ(fsdp.last_step_stats().wire.total().total(), trained.wire.total().total());
    fsdp.finish();
  });
}

}  // namespace
}  // namespace dtrain

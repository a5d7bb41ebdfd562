// Failures and bad input under DataParallel and FullyShardedDataParallel: an exception in
// forward, in loss.backward() or in a communication hook, on one rank or on all, must leave
// every rank either ready for the next step (the step dropped everywhere, training then
// matching single-device training without that step) or failing with a clear error within
// the communicator timeout; never one rank hanging. Uneven data is a clear error. A unit run
// twice per forward (weight sharing) trains as on a single device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "strategy/inspect.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = std::chrono::seconds(4);

CommunicatorOptions short_timeout() {
  CommunicatorOptions o;
  o.timeout = kTimeout;
  return o;
}

CommunicatorPtr borrow(Communicator& c) {
  return std::shared_ptr<Communicator>(&c, [](Communicator*) {});
}

// --- weight sharing ---

// fc1, then `shared` twice (a unit run twice per forward), then fc3.
struct SharedMlpImpl : torch::nn::Module {
  SharedMlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 16))),
        shared(register_module("shared", torch::nn::Linear(16, 16))),
        fc3(register_module("fc3", torch::nn::Linear(16, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(dtrain::unit_call(*fc1, [&] { return fc1->forward(x); }));
    for (int k = 0; k < 2; ++k) {
      h = at::tanh(dtrain::unit_call(*shared, [&] { return shared->forward(h); }));
    }
    return fc3->forward(h);
  }
  torch::nn::Linear fc1, shared, fc3;
};
TORCH_MODULE(SharedMlp);

struct SharingCase {
  std::string name;
  int world = 2;
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  BackwardPrefetch prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  bool keep_between_calls = true;  // FsdpOptions::keep_gathered_between_calls
};

class FsdpWeightSharing : public ::testing::TestWithParam<SharingCase> {};

TEST_P(FsdpWeightSharing, UnitRunTwicePerForwardMatchesSingleDevice) {
  const SharingCase sc = GetParam();
  at::set_num_threads(1);
  torch::manual_seed(5);
  std::vector<at::Tensor> xs, ys;
  for (int s = 0; s < kSteps; ++s) {
    xs.push_back(at::randn({kLocalBatch * sc.world, 6}));
    ys.push_back(at::randn({kLocalBatch * sc.world, 4}));
  }
  auto run = [&](Strategy& s, SharedMlp& m, int64_t row0, int64_t rows) {
    torch::optim::SGD opt(s.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      at::Tensor l = s.forward([&] {
        return at::mse_loss(m->forward(xs[step].narrow(0, row0, rows)),
                            ys[step].narrow(0, row0, rows));
      });
      s.backward(l);
      opt.step();
    }
  };
  torch::manual_seed(7);
  SharedMlp ref;
  SingleDevice single(ref.ptr());
  run(single, ref, 0, kLocalBatch * sc.world);

  std::vector<SharedMlp> models;
  for (int r = 0; r < sc.world; ++r) {
    torch::manual_seed(7);
    models.emplace_back();
  }
  std::vector<std::vector<std::string>> logs(sc.world);
  run_ranks(sc.world, [&](Communicator& comm) {
    const int r = comm.rank();
    FsdpOptions o;
    o.sharding = sc.sharding;
    o.backward_prefetch = sc.prefetch;
    o.forward_prefetch = sc.forward_prefetch;
    o.keep_gathered_between_calls = sc.keep_between_calls;
    o.wrap_policy = [](const std::string& name, const torch::nn::Module&) {
      return name == "fc1" || name == "shared";
    };
    FullyShardedDataParallel fsdp(models[r].ptr(), borrow(comm), o);
    run(fsdp, models[r], r * kLocalBatch, kLocalBatch);
    logs[r] = detail::Inspect::last_collective_log(fsdp);
    auto state = fsdp.full_state_dict();
    if (r != 0) return;
    for (const auto& [name, t] : state) {
      const at::Tensor want = ref->named_parameters()[name];
      DTRAIN_CHECK(at::allclose(t, want, 1e-5, 1e-6),
                   "{} differs from single-device training: max |diff| {}", name,
                   (t - want).abs().max().item<double>());
    }
  });
  // The shared unit's gradient is reduced once per step, after its first use's backward.
  if (sc.world > 1 && sc.sharding != ShardingStrategy::kNoShard) {
    size_t reductions = 0;
    for (const auto& e : logs[0]) reductions += e == "reduce_scatter:shared";
    EXPECT_EQ(reductions, 1u) << fmt::format("{}", fmt::join(logs[0], ", "));
  }
  // FULL_SHARD gathers it in forward once (kept between its two calls) or once per call,
  // and once more for backward.
  if (sc.world > 1 && sc.sharding == ShardingStrategy::kFullShard) {
    size_t gathers = 0;
    for (const auto& e : logs[0]) gathers += e.rfind("all_gather:shared", 0) == 0;
    EXPECT_EQ(gathers, sc.keep_between_calls ? 2u : 3u)
        << fmt::format("{}", fmt::join(logs[0], ", "));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FsdpWeightSharing,
    ::testing::Values(SharingCase{"full_shard_world2", 2},
                      SharingCase{"full_shard_world3_prefetch_post", 3,
                                  ShardingStrategy::kFullShard, BackwardPrefetch::kBackwardPost},
                      SharingCase{"full_shard_world2_forward_prefetch", 2,
                                  ShardingStrategy::kFullShard, BackwardPrefetch::kNone, true},
                      SharingCase{"full_shard_world2_freed_between_calls", 2,
                                  ShardingStrategy::kFullShard, BackwardPrefetch::kBackwardPre,
                                  false, false},
                      SharingCase{"shard_grad_op_world2", 2, ShardingStrategy::kShardGradOp},
                      SharingCase{"no_shard_world2", 2, ShardingStrategy::kNoShard}),
    [](const auto& info) { return info.param.name; });

// --- exceptions in a step ---

enum class Kind { kDdp, kFsdp };
enum class Where { kForward, kBackward, kBackwardBeforeAnyHook, kHookContinuation };
void PrintTo(Kind k, std::ostream* os) { *os << (k == Kind::kDdp ? "ddp" : "fsdp"); }

struct FailureCase {
  std::string name;
  Kind kind = Kind::kDdp;
  Where where = Where::kForward;
  int world = 3;
  bool all_ranks = false;  // every rank fails, else rank 1 only
  bool eval = false;       // the failing forward runs without grad (an evaluation step)
};

// Identity forward; backward throws. Inserted between two blocks on the failing rank, so the
// failure comes in the middle of backward, after some gradients were reduced.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 const torch::autograd::variable_list&) {
    throw std::runtime_error("injected failure in backward");
  }
};

// The tiny transformer's forward written out, so that a failure can be injected inside a
// unit (forward) or between units (backward).
at::Tensor transformer_loss(TinyTransformerImpl& tf, const at::Tensor& x, const at::Tensor& y,
                            bool fail_in_unit, bool fail_in_backward) {
  at::Tensor pos = at::arange(x.size(1), x.options());
  at::Tensor h = tf.wte->forward(x) + tf.wpe->forward(pos);
  for (size_t k = 0; k < tf.blocks.size(); ++k) {
    auto& b = tf.blocks[k];
    h = dtrain::unit_call(*b, [&] {
      if (fail_in_unit && k == 1) throw std::runtime_error("injected failure in forward");
      return b->forward(h);
    });
    if (fail_in_backward && k == 0) h = ThrowInBackward::apply(h);
  }
  at::Tensor logits = torch::nn::functional::linear(tf.ln_f->forward(h), tf.wte->weight);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

// Averages in fp32 and copies back in a continuation; the continuation throws on `fail`.
class FailingContinuationHook : public CommHook {
 public:
  explicit FailingContinuationHook(std::atomic<bool>* fail) : fail_(fail) {}
  WorkPtr run(Communicator& comm, GradBucket& b) override {
    auto work = comm.all_reduce(b.buffer, ReduceOp::kAvg);
    if (b.index != 0 || !fail_->load()) return work;
    return then(work, [] { throw std::runtime_error("injected failure in a hook continuation"); });
  }
  std::string name() const override { return "failing_continuation"; }

 private:
  std::atomic<bool>* fail_;
};

constexpr int kFailStep = 2;

void PrintTo(const FailureCase& c, std::ostream* os) { *os << c.name; }
void PrintTo(const SharingCase& c, std::ostream* os) { *os << c.name; }

class StepFailures : public ::testing::TestWithParam<FailureCase> {};

// Trains kSteps; step kFailStep fails on rank 1 (or every rank). Every rank must throw from
// that step (the failing one its own exception, the others StepError naming rank 1), go on,
// and end where single-device training ends when it skips that step.
TEST_P(StepFailures, EveryRankDropsTheStepAndTrainingGoesOn) {
  const FailureCase fc = GetParam();
  at::set_num_threads(1);
  const int world = fc.world;
  const auto data = make_data(Model::kTransformer, world);
  Case c;
  c.model = Model::kTransformer;

  // Reference: single-device training on the global batch, without the failed step.
  auto ref = make_model(Model::kTransformer, 7);
  {
    SingleDevice single(ref);
    auto opt = make_opt(Opt::kSgd, single.parameters());
    for (int s = 0; s < kSteps; ++s) {
      if (s == kFailStep) continue;
      opt->zero_grad();
      at::Tensor l =
          single.forward([&] { return loss_of(c.model, *ref, data[s].x, data[s].y, false); });
      single.backward(l);
      opt->step();
    }
  }

  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(make_model(Model::kTransformer, 7));
  const auto started = Clock::now();
  run_ranks(
      world,
      [&](Communicator& comm) {
        const int r = comm.rank();
        const bool fails = fc.all_ranks || r == 1;
        std::atomic<bool> fail_hook{false};
        std::unique_ptr<Strategy> strategy;
        if (fc.kind == Kind::kDdp) {
          DataParallelOptions o;
          o.bucket_cap_mb = 0.004;  // several buckets: some are reduced before a failure
          o.first_bucket_cap_mb = 0.001;
          if (fc.where == Where::kHookContinuation) {
            o.comm_hook = std::make_shared<FailingContinuationHook>(&fail_hook);
          }
          strategy = std::make_unique<DataParallel>(modules[r], borrow(comm), o);
        } else {
          FsdpOptions o;
          // The flat shards this test was written for (the default before the step driver):
          // with per-parameter views, 2.x's zero_grad() leaves the shard's gradient to the
          // next forward, which releases it, so the bytes before the failed step would count
          // a buffer any step frees.
          o.use_orig_params = false;
          o.wrap_policy = [](const std::string& name, const torch::nn::Module& m) {
            return m.name().find("BlockImpl") != std::string::npos || name == "h1.up";
          };
          strategy = std::make_unique<FullyShardedDataParallel>(modules[r], borrow(comm), o);
        }
        auto& tf = static_cast<TinyTransformerImpl&>(*modules[r]);
        auto opt = make_opt(Opt::kSgd, strategy->parameters());
        int64_t bytes_before = 0;
        for (int s = 0; s < kSteps; ++s) {
          const bool inject = s == kFailStep && fails;
          at::Tensor x = data[s].x.narrow(0, r * kLocalBatch, kLocalBatch);
          at::Tensor y = data[s].y.narrow(0, r * kLocalBatch, kLocalBatch);
          // The release's own zero_grad(): zeroes in place (1.13) or resets to undefined (2.x),
          // and a failed step must leave either as it found it. The step starts after it.
          opt->zero_grad();
          if (s == kFailStep) bytes_before = strategy->model_state_bytes();
          try {
            if (fc.eval && s == kFailStep) {
              c10::NoGradGuard no_grad;
              strategy->forward([&] { return transformer_loss(tf, x, y, inject, false); });
              DTRAIN_CHECK(false, "rank {}: the evaluation step did not fail", r);
            }
            fail_hook = inject && fc.where == Where::kHookContinuation;
            at::Tensor l = strategy->forward([&] {
              return transformer_loss(tf, x, y, inject && fc.where == Where::kForward,
                                      inject && fc.where == Where::kBackward);
            });
            strategy->backward(inject && fc.where == Where::kBackwardBeforeAnyHook ? l.detach()
                                                                                   : l);
            DTRAIN_CHECK(s != kFailStep, "rank {}: step {} did not fail", r, s);
            opt->step();
          } catch (const StepError& e) {
            DTRAIN_CHECK(s == kFailStep && !fails, "rank {} step {}: unexpected {}", r, s,
                         e.what());
            const std::string what = e.what();
            const char* cause =
                fc.where == Where::kBackwardBeforeAnyHook ? "does not require grad" : "injected";
            DTRAIN_CHECK(what.find("failed on rank 1: ") != std::string::npos &&
                             what.find(cause) != std::string::npos,
                         "rank {}: {}", r, what);
          } catch (const Error&) {
            throw;  // a dtrain error other than StepError: the strategy did not recover
          } catch (const std::exception& e) {
            DTRAIN_CHECK(s == kFailStep && fails, "rank {} step {}: unexpected {}", r, s, e.what());
          }
          // Reset: no unit left gathered, no gradient buffer left behind.
          DTRAIN_CHECK(s != kFailStep || strategy->model_state_bytes() == bytes_before,
                       "rank {}: {} bytes of model state after the failed step, {} before", r,
                       strategy->model_state_bytes(), bytes_before);
        }
        if (fc.kind == Kind::kFsdp) {
          auto state = static_cast<FullyShardedDataParallel&>(*strategy).full_state_dict();
          if (r != 0) return;
          for (const auto& [name, t] : state) {
            if (!ref->named_parameters().contains(name)) continue;
            const at::Tensor want = ref->named_parameters()[name];
            DTRAIN_CHECK(at::allclose(t, want, 1e-5, 1e-6), "{} differs: max |diff| {}", name,
                         (t - want).abs().max().item<double>());
          }
        } else {
          expect_same_parameters(*ref, *modules[r], r, 1e-5, 1e-6);
        }
      },
      short_timeout());
  // No rank waited for a timeout.
  EXPECT_LT(Clock::now() - started, kTimeout);
}

std::vector<FailureCase> failure_cases() {
  std::vector<FailureCase> out;
  for (Kind k : {Kind::kDdp, Kind::kFsdp}) {
    const std::string s = k == Kind::kDdp ? "ddp" : "fsdp";
    out.push_back({s + "_forward_one_rank", k, Where::kForward});
    out.push_back({s + "_forward_all_ranks", k, Where::kForward, 2, true});
    out.push_back({s + "_eval_forward_one_rank", k, Where::kForward, 3, false, true});
    out.push_back({s + "_backward_one_rank", k, Where::kBackward});
    out.push_back({s + "_backward_all_ranks", k, Where::kBackward, 2, true});
    out.push_back({s + "_backward_before_any_hook_one_rank", k, Where::kBackwardBeforeAnyHook});
  }
  out.push_back({"ddp_hook_continuation_one_rank", Kind::kDdp, Where::kHookContinuation});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, StepFailures, ::testing::ValuesIn(failure_cases()),
                         [](const auto& info) { return info.param.name; });

// A hook that throws while issuing (how many collectives it issued is unknown) cannot be
// recovered: that rank's strategy throws the hook's error, then CommError on every later
// call, and issues nothing more; its peers fail within the communicator timeout.
class ThrowingHook : public CommHook {
 public:
  explicit ThrowingHook(bool fail) : fail_(fail) {}
  WorkPtr run(Communicator& comm, GradBucket& b) override {
    if (fail_ && b.index == 1) throw std::runtime_error("injected failure in a hook");
    return comm.all_reduce(b.buffer, ReduceOp::kAvg);
  }
  std::string name() const override { return "throwing"; }

 private:
  bool fail_;
};

TEST(StepFailuresUnrecoverable, HookThrowingWhileIssuingFailsEveryRankWithinTheTimeout) {
  at::set_num_threads(1);
  const int world = 2;
  const auto data = make_data(Model::kMlp, world);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(make_model(Model::kMlp, 7));
  std::vector<std::string> errors(world);
  const auto started = Clock::now();
  run_ranks(
      world,
      [&](Communicator& comm) {
        const int r = comm.rank();
        DataParallelOptions o;
        o.bucket_cap_mb = 0.0005;
        o.first_bucket_cap_mb = 0.0001;
        o.comm_hook = std::make_shared<ThrowingHook>(r == 1);
        DataParallel ddp(modules[r], borrow(comm), o);
        auto& mlp = static_cast<MlpImpl&>(*modules[r]);
        at::Tensor x = data[0].x.narrow(0, r * kLocalBatch, kLocalBatch);
        at::Tensor y = data[0].y.narrow(0, r * kLocalBatch, kLocalBatch);
        try {
          at::Tensor l = ddp.forward([&] { return at::mse_loss(mlp.forward(x), y); });
          ddp.backward(l);
          DTRAIN_CHECK(false, "rank {}: backward succeeded", r);
        } catch (const CommError& e) {
          errors[r] = e.what();
        } catch (const std::exception& e) {
          DTRAIN_CHECK(r == 1, "rank {}: {}", r, e.what());
          errors[r] = e.what();
          // Every later call refuses, naming the cause.
          try {
            ddp.forward([&] { return at::mse_loss(mlp.forward(x), y); });
            DTRAIN_CHECK(false, "rank 1: a broken strategy ran a step");
          } catch (const CommError& again) {
            DTRAIN_CHECK(
                std::string(again.what()).find("injected failure in a hook") != std::string::npos,
                "{}", again.what());
          }
        }
      },
      short_timeout());
  EXPECT_LT(Clock::now() - started, 2 * kTimeout + std::chrono::seconds(2));
  EXPECT_NE(errors[1].find("injected failure in a hook"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("gradient collective failed"), std::string::npos) << errors[0];
}

// --- uneven data ---

class UnevenData : public ::testing::TestWithParam<Kind> {};

std::unique_ptr<Strategy> make_strategy(Kind k, std::shared_ptr<torch::nn::Module> m,
                                        Communicator& comm) {
  if (k == Kind::kDdp) return std::make_unique<DataParallel>(m, borrow(comm));
  return std::make_unique<FullyShardedDataParallel>(m, borrow(comm));
}

// Rank 1 has 2 batches, the others 3: rank 1's finish() meets the others' third forward.
TEST_P(UnevenData, RankWithoutBatchIsAClearErrorOnEveryRank) {
  at::set_num_threads(1);
  const int world = 3;
  const auto data = make_data(Model::kMlp, world);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(make_model(Model::kMlp, 7));
  std::vector<std::string> errors(world);
  const auto started = Clock::now();
  run_ranks(
      world,
      [&](Communicator& comm) {
        const int r = comm.rank();
        auto s = make_strategy(GetParam(), modules[r], comm);
        auto& mlp = static_cast<MlpImpl&>(*modules[r]);
        try {
          for (int step = 0; step < (r == 1 ? 2 : 3); ++step) {
            at::Tensor x = data[step].x.narrow(0, r * kLocalBatch, kLocalBatch);
            at::Tensor y = data[step].y.narrow(0, r * kLocalBatch, kLocalBatch);
            at::Tensor l = s->forward([&] { return at::mse_loss(mlp.forward(x), y); });
            s->backward(l);
          }
          s->finish();
        } catch (const InvalidArgument& e) {
          errors[r] = e.what();
        }
      },
      short_timeout());
  EXPECT_LT(Clock::now() - started, kTimeout);
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(errors[r].find("rank 1 had no batch at step 2 while ranks 0, 2 did"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// Every rank out of data at the same step: finish() returns everywhere.
TEST_P(UnevenData, EvenDataFinishesQuietly) {
  at::set_num_threads(1);
  const auto data = make_data(Model::kMlp, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < 2; ++r) modules.push_back(make_model(Model::kMlp, 7));
  run_ranks(
      2,
      [&](Communicator& comm) {
        const int r = comm.rank();
        auto s = make_strategy(GetParam(), modules[r], comm);
        auto& mlp = static_cast<MlpImpl&>(*modules[r]);
        for (int step = 0; step < 2; ++step) {
          at::Tensor x = data[step].x.narrow(0, r * kLocalBatch, kLocalBatch);
          at::Tensor y = data[step].y.narrow(0, r * kLocalBatch, kLocalBatch);
          s->backward(s->forward([&] { return at::mse_loss(mlp.forward(x), y); }));
        }
        s->finish();
      },
      short_timeout());
}

// A rank that stops without finish() (it exits): the others fail at the start of the next
// step, within the timeout, saying where and what to do.
TEST_P(UnevenData, RankThatExitsWithoutFinishFailsThePeersClearly) {
  at::set_num_threads(1);
  const auto data = make_data(Model::kMlp, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < 2; ++r) modules.push_back(make_model(Model::kMlp, 7));
  std::string error;
  const auto started = Clock::now();
  run_ranks(
      2,
      [&](Communicator& comm) {
        const int r = comm.rank();
        auto s = make_strategy(GetParam(), modules[r], comm);
        auto& mlp = static_cast<MlpImpl&>(*modules[r]);
        try {
          for (int step = 0; step < (r == 1 ? 1 : 2); ++step) {
            at::Tensor x = data[step].x.narrow(0, r * kLocalBatch, kLocalBatch);
            at::Tensor y = data[step].y.narrow(0, r * kLocalBatch, kLocalBatch);
            s->backward(s->forward([&] { return at::mse_loss(mlp.forward(x), y); }));
          }
        } catch (const CommError& e) {
          error = e.what();
        }
      },
      short_timeout());
  EXPECT_LT(Clock::now() - started, 2 * kTimeout + std::chrono::seconds(2));
  EXPECT_NE(error.find("did not meet at the start of step 1"), std::string::npos) << error;
  EXPECT_NE(error.find("finish()"), std::string::npos) << error;
}

INSTANTIATE_TEST_SUITE_P(Strategies, UnevenData, ::testing::Values(Kind::kDdp, Kind::kFsdp),
                         [](const auto& info) {
                           return std::string(info.param == Kind::kDdp ? "ddp" : "fsdp");
                         });

}  // namespace
}  // namespace dtrain

// DataParallel against the reference: N ranks (threads, Gloo over loopback) training on
// their slices of a global batch must end with the parameters that SingleDevice reaches
// training on the whole global batch.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/powersgd.h"
#include "dtrain/single_device.h"
#include "strategy/inspect.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

class DataParallelEquivalence : public ::testing::TestWithParam<std::tuple<int, Case>> {};

TEST_P(DataParallelEquivalence, MatchesSingleDeviceOnTheGlobalBatch) {
  const int world = std::get<0>(GetParam());
  const Case c = std::get<1>(GetParam());
  at::set_num_threads(1);
  const auto data = make_data(c.model, world);

  auto ref_module = single_device_reference(c, data, world);
  // Rank 0 starts from the reference's initial weights; the others from different ones,
  // which DataParallel must overwrite with rank 0's.
  auto modules = rank_models(c.model, world);

  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    const DataParallelOptions o = ddp_options(c);
    DataParallel ddp(modules[r], std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    train(c, ddp, *modules[r], data, r * kLocalBatch, kLocalBatch, &ddp);
    expect_same_parameters(*ref_module, *modules[r], r, c.rtol, c.atol);
  });
}

// PowerSGD compressing every matrix at full rank (r = min(rows, columns)): P P^T projects
// onto the whole column space of the summed gradient, so the result is the all-reduce's.
std::shared_ptr<CommHook> full_rank_powersgd() {
  PowerSgdOptions o;
  o.rank = 1 << 20;
  o.start_iter = 0;
  o.min_compression_rate = 0;
  o.error_feedback = false;
  o.warm_start = false;
  return powersgd_hook(o);
}

std::vector<Case> cases() {
  auto make = [](std::string name, const std::function<void(Case&)>& set) {
    Case c;
    c.name = std::move(name);
    set(c);
    return c;
  };
  return {
      make("mlp_sgd", [](Case&) {}),
      make("transformer_sgd", [](Case& c) { c.model = Model::kTransformer; }),
      // Adam divides by sqrt(v): round-off in tiny gradients is amplified, hence 1e-4.
      make("transformer_adamw",
           [](Case& c) {
             c.model = Model::kTransformer;
             c.opt = Opt::kAdamW;
             c.rtol = 1e-4;
             c.atol = 1e-5;
           }),
      // Tiny buckets: many buckets, exercising launch order and the first-bucket cap.
      make("transformer_small_buckets",
           [](Case& c) {
             c.model = Model::kTransformer;
             c.bucket_mb = 0.004;
             c.first_bucket_mb = 0.001;
           }),
      make("mlp_no_sync_accumulation", [](Case& c) { c.accumulate = true; }),
      // Gradients reset to none between steps (LibTorch 2.x's zero_grad() default, and the
      // GPT-2 trainer's): DDP brings them back into its buckets, also under no_sync.
      make("mlp_no_sync_accumulation_set_to_none",
           [](Case& c) {
             c.accumulate = true;
             c.set_to_none = true;
           }),
      make("transformer_small_buckets_set_to_none",
           [](Case& c) {
             c.model = Model::kTransformer;
             c.bucket_mb = 0.004;
             c.first_bucket_mb = 0.001;
             c.set_to_none = true;
           }),
      // Without find_unused_parameters an unused parameter gets a zero gradient (momentum
      // still moves it), unlike single-device training's none: only with the flag do
      // they match.
      make("mlp_unused_sgd_find_unused_set_to_none",
           [](Case& c) {
             c.skip_extra = true;
             c.find_unused = true;
             c.set_to_none = true;
           }),
      make("mlp_unused_sgd", [](Case& c) { c.skip_extra = true; }),
      make("mlp_unused_adamw_find_unused",
           [](Case& c) {
             c.opt = Opt::kAdamW;
             c.skip_extra = true;
             c.find_unused = true;
             c.rtol = 1e-4;
             c.atol = 1e-5;
           }),
      make("mlp_unused_adamw_find_unused_set_to_none",
           [](Case& c) {
             c.opt = Opt::kAdamW;
             c.skip_extra = true;
             c.find_unused = true;
             c.set_to_none = true;
             c.rtol = 1e-4;
             c.atol = 1e-5;
           }),
      // A parameter used only in the no_sync micro-batch is used: its accumulated gradient
      // is reduced at the synced step, not dropped (c10d's rule for find_unused_parameters).
      make("mlp_extra_only_in_no_sync_find_unused_set_to_none",
           [](Case& c) {
             c.accumulate = true;
             c.extra_in_first_micro_batch_only = true;
             c.find_unused = true;
             c.set_to_none = true;
           }),
      make("mlp_extra_only_in_no_sync_find_unused",
           [](Case& c) {
             c.accumulate = true;
             c.extra_in_first_micro_batch_only = true;
             c.find_unused = true;
           }),
      make("mlp_parameter_server",
           [](Case& c) { c.hook = [] { return parameter_server_hook(0); }; }),
      // Compression rounds gradients to 11 (fp16) or 8 (bf16) significant bits.
      make("mlp_fp16_compress",
           [](Case& c) {
             c.hook = fp16_compress_hook;
             c.rtol = 1e-2;
             c.atol = 2e-3;
           }),
      make("mlp_bf16_compress",
           [](Case& c) {
             c.hook = bf16_compress_hook;
             // Measured here: max |diff| 6.5e-4 (worlds 1-4).
             c.rtol = 1e-2;
             c.atol = 2e-3;
           }),
      // Gram-Schmidt and the two products add fp32 round-off, nothing more.
      make("mlp_powersgd_full_rank",
           [](Case& c) {
             c.hook = full_rank_powersgd;
             c.rtol = 1e-4;
             c.atol = 1e-5;
           }),
      make("transformer_powersgd_full_rank",
           [](Case& c) {
             c.model = Model::kTransformer;
             c.hook = full_rank_powersgd;
             c.rtol = 1e-4;
             c.atol = 1e-5;
           }),
  };
}

INSTANTIATE_TEST_SUITE_P(Ranks, DataParallelEquivalence,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::ValuesIn(cases())),
                         [](const auto& info) {
                           return std::get<1>(info.param).name + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

TEST(DataParallelModelCheck, MismatchedModelFailsOnEveryRankNamingTheDifference) {
  at::set_num_threads(1);
  std::vector<std::shared_ptr<torch::nn::Module>> modules = {Mlp(6, 16, 4).ptr(),
                                                             Mlp(6, 17, 4).ptr()};
  std::atomic<int> failures{0};
  run_ranks(2, [&](Communicator& comm) {
    try {
      DataParallel ddp(modules[comm.rank()],
                       std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    } catch (const InvalidArgument& e) {
      std::string msg = e.what();
      DTRAIN_CHECK(
          msg.find("fc1.weight") != std::string::npos && msg.find("[16, 6]") != std::string::npos &&
              msg.find("[17, 6]") != std::string::npos && msg.find("rank 1") != std::string::npos,
          "unhelpful message: {}", msg);
      ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 2);
}

TEST(DataParallelBuckets, AssignmentRespectsCapsDtypesAndOrder) {
  // Sizes in bytes, walked in reverse registration order as DataParallel does.
  std::vector<int64_t> bytes = {400, 100, 100, 300, 50, 2000};
  std::vector<int> dtype = {0, 0, 0, 0, 1, 0};
  std::vector<size_t> order = {5, 4, 3, 2, 1, 0};
  auto b = detail::assign_buckets(order, bytes, dtype, /*first=*/100, /*cap=*/500);
  // 5 is larger than any cap: alone. 4 has another dtype: alone. Then 3+2+1 = 500 fits
  // the cap, and 0 starts a new bucket.
  std::vector<std::vector<size_t>> want = {{5}, {4}, {3, 2, 1}, {0}};
  EXPECT_EQ(b, want);
  // First-bucket cap applies to the first bucket only.
  auto c = detail::assign_buckets({1, 2, 3}, {60, 60, 60, 60}, {0, 0, 0, 0}, 100, 1000);
  std::vector<std::vector<size_t>> want_c = {{1}, {2, 3}};
  EXPECT_EQ(c, want_c);
  EXPECT_THROW(detail::assign_buckets({7}, bytes, dtype, 100, 500), InvalidArgument);
}

// Four 4x4 matrices applied as a chain in an order each rank chooses. A parameter's gradient
// is ready when backward reaches its use, so gradients become ready in the reverse of the use
// order: ranks with different orders see different ready orders.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    for (int i = 0; i < 4; ++i) {
      w.push_back(register_parameter("w" + std::to_string(i), at::randn({4, 4}) * 0.5));
    }
  }
  at::Tensor forward(at::Tensor h, const std::vector<int>& use_order) {
    for (int i : use_order) h = at::tanh(h.mm(w[i]));
    return h;
  }
  std::vector<at::Tensor> w;
};
TORCH_MODULE(Chain);

// Averages like the default hook and logs what each bucket holds as it is issued ("b0:w3"),
// and whether backward had already reached the model's input by then.
class LoggingHook : public CommHook {
 public:
  LoggingHook(Chain chain, const std::atomic<bool>* input_reached)
      : chain_(std::move(chain)), input_reached_(input_reached) {}
  WorkPtr run(Communicator& comm, GradBucket& b) override {
    std::string entry = "b" + std::to_string(b.index) + ":";
    for (const at::Tensor& p : b.parameters) {
      for (size_t i = 0; i < chain_->w.size(); ++i) {
        if (p.is_same(chain_->w[i])) entry += "w" + std::to_string(i);
      }
    }
    log.push_back(entry);
    issued_after_backward.push_back(input_reached_->load());
    return comm.all_reduce(b.buffer, ReduceOp::kAvg);
  }
  std::string name() const override { return "logging_average"; }

  std::vector<std::string> log;
  std::vector<bool> issued_after_backward;

 private:
  Chain chain_;
  const std::atomic<bool>* input_reached_;
};

// One rank of the chain tests: the model, DataParallel over it with every 64-byte parameter
// in a bucket of its own, and the logging hook.
struct ChainRank {
  ChainRank(Communicator& comm, bool rebuild_buckets)
      : hook(std::make_shared<LoggingHook>(chain, &input_reached)),
        ddp(chain.ptr(), std::shared_ptr<Communicator>(&comm, [](Communicator*) {}),
            options(hook, rebuild_buckets)) {}

  static DataParallelOptions options(std::shared_ptr<CommHook> hook, bool rebuild_buckets) {
    DataParallelOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 64.0 / (1 << 20);
    o.comm_hook = std::move(hook);
    o.rebuild_buckets = rebuild_buckets;
    return o;
  }

  // One training step using the matrices in `use_order`; `input_reached` turns true when
  // backward reaches the input (the end of backward).
  void step(const std::vector<int>& use_order, int rank) {
    input_reached = false;
    at::Tensor x = (at::arange(8, at::kFloat).view({2, 4}) * 0.1 * (rank + 1)).requires_grad_(true);
    x.register_hook([this](const at::Tensor&) { input_reached = true; });
    at::Tensor loss = ddp.forward([&] { return chain->forward(x, use_order).sum(); });
    ddp.backward(loss);
  }

  Chain chain;
  std::atomic<bool> input_reached{false};
  std::shared_ptr<LoggingHook> hook;
  DataParallel ddp;
};

std::vector<at::Tensor> grads(const Chain& chain) {
  std::vector<at::Tensor> g;
  for (const auto& w : chain->w) g.push_back(w.grad().clone());
  return g;
}

void expect_same_grads(const std::vector<std::vector<at::Tensor>>& per_rank) {
  for (size_t r = 1; r < per_rank.size(); ++r) {
    for (size_t i = 0; i < per_rank[0].size(); ++i) {
      EXPECT_TRUE(at::equal(per_rank[r][i], per_rank[0][i]))
          << "w" << i << "'s averaged gradient differs between rank 0 and rank " << r;
    }
  }
}

// Whatever order gradients become ready in on each rank, every rank issues the buckets in
// bucket order (else ranks would reduce different parameters together), and a bucket whose
// gradients are ready goes out while backward still runs.
TEST(DataParallelBuckets, IssuedInBucketOrderWhateverOrderGradientsBecomeReady) {
  at::set_num_threads(1);
  const int world = 3;
  // Ready orders: rank 0 w3 w2 w1 w0 (the bucket order), rank 1 the reverse, rank 2 mixed.
  const std::vector<std::vector<int>> use_order = {{0, 1, 2, 3}, {3, 2, 1, 0}, {1, 3, 0, 2}};
  std::vector<std::vector<std::string>> logs(world);
  std::vector<std::vector<bool>> late(world);
  std::vector<std::vector<at::Tensor>> reduced(world);
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    ChainRank me(comm, /*rebuild_buckets=*/false);
    me.step(use_order[r], r);
    const auto& st = me.ddp.last_step_stats();
    DTRAIN_CHECK(st.num_collectives == 4, "{} collectives", st.num_collectives);
    DTRAIN_CHECK(st.bytes_communicated == 4 * 64, "{} bytes", st.bytes_communicated);
    logs[r] = me.hook->log;
    late[r] = me.hook->issued_after_backward;
    reduced[r] = grads(me.chain);
  });
  const std::vector<std::string> want = {"b0:w3", "b1:w2", "b2:w1", "b3:w0"};
  for (int r = 0; r < world; ++r) EXPECT_EQ(logs[r], want) << "rank " << r;
  // Rank 0's gradients are ready in bucket order: its first bucket overlaps backward.
  ASSERT_FALSE(late[0].empty());
  EXPECT_FALSE(late[0][0]) << "rank 0 issued its first bucket only after backward";
  expect_same_grads(reduced);
}

// After the first step the buckets are rebuilt in the order gradients became ready on rank
// 0, broadcast so that every rank builds the same buckets although its own order differs;
// the next step issues and reduces the rebuilt buckets.
TEST(DataParallelBuckets, RebuildUsesRankZerosReadyOrderOnEveryRank) {
  at::set_num_threads(1);
  const int world = 3;
  // Ready orders: rank 0 w2 w0 w3 w1, rank 1 w3 w2 w1 w0 (the initial buckets), rank 2 w0 w1
  // w2 w3.
  const std::vector<std::vector<int>> use_order = {{1, 3, 0, 2}, {0, 1, 2, 3}, {3, 2, 1, 0}};
  using Assignment = std::vector<std::vector<size_t>>;
  std::vector<Assignment> before(world), after(world);
  std::vector<std::vector<std::string>> logs(world);
  std::vector<std::vector<at::Tensor>> reduced(world);
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    ChainRank me(comm, /*rebuild_buckets=*/true);
    me.step(use_order[r], r);
    before[r] = detail::Inspect::bucket_assignment(me.ddp);
    me.hook->log.clear();
    me.step(use_order[r], r);
    after[r] = detail::Inspect::bucket_assignment(me.ddp);
    logs[r] = me.hook->log;
    reduced[r] = grads(me.chain);
  });
  const Assignment initial = {{3}, {2}, {1}, {0}}, rank0_ready = {{2}, {0}, {3}, {1}};
  const std::vector<std::string> want = {"b0:w2", "b1:w0", "b2:w3", "b3:w1"};
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(before[r], initial) << "rank " << r;
    EXPECT_EQ(after[r], rank0_ready) << "rank " << r;
    EXPECT_EQ(logs[r], want) << "rank " << r;
  }
  expect_same_grads(reduced);
}

}  // namespace
}  // namespace dtrain

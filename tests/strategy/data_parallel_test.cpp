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
#include "dtrain/single_device.h"
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

  auto ref_module = make_model(c.model, 7);
  SingleDevice single(ref_module);
  train(c, single, *ref_module, data, 0, kLocalBatch * world, nullptr);

  // Rank 0 starts from the reference's initial weights; the others from different ones,
  // which DataParallel must overwrite with rank 0's.
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(make_model(c.model, r == 0 ? 7 : 100 + r));

  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    DataParallelOptions o;
    o.comm_hook = c.hook ? c.hook() : nullptr;
    o.find_unused_parameters = c.find_unused;
    o.bucket_cap_mb = c.bucket_mb;
    o.first_bucket_cap_mb = c.first_bucket_mb;
    DataParallel ddp(modules[r], std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    train(c, ddp, *modules[r], data, r * kLocalBatch, kLocalBatch, &ddp);
    expect_same_parameters(*ref_module, *modules[r], r, c.rtol, c.atol);
  });
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
             c.rtol = 5e-2;
             c.atol = 1e-2;
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
  auto b = assign_buckets(order, bytes, dtype, /*first=*/100, /*cap=*/500);
  // 5 is larger than any cap: alone. 4 has another dtype: alone. Then 3+2+1 = 500 fits
  // the cap, and 0 starts a new bucket.
  std::vector<std::vector<size_t>> want = {{5}, {4}, {3, 2, 1}, {0}};
  EXPECT_EQ(b, want);
  // First-bucket cap applies to the first bucket only.
  auto c = assign_buckets({1, 2, 3}, {60, 60, 60, 60}, {0, 0, 0, 0}, 100, 1000);
  std::vector<std::vector<size_t>> want_c = {{1}, {2, 3}};
  EXPECT_EQ(c, want_c);
  EXPECT_THROW(assign_buckets({7}, bytes, dtype, 100, 500), InvalidArgument);
}

TEST(DataParallelBuckets, LaunchesInOrderAndRebuildsIdenticallyOnEveryRank) {
  at::set_num_threads(1);
  const int world = 3;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) modules.push_back(make_model(Model::kTransformer, 7));
  const auto data = make_data(Model::kTransformer, world);
  std::mutex mu;
  std::vector<std::vector<std::vector<size_t>>> assignments(world);
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    DataParallelOptions o;
    o.bucket_cap_mb = 0.004;
    o.first_bucket_cap_mb = 0.001;
    DataParallel ddp(modules[r], std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), o);
    auto& tf = static_cast<testing::TinyTransformerImpl&>(*modules[r]);
    for (int s = 0; s < 3; ++s) {
      at::Tensor x = data[s].x.narrow(0, r * kLocalBatch, kLocalBatch);
      at::Tensor y = data[s].y.narrow(0, r * kLocalBatch, kLocalBatch);
      at::Tensor l = ddp.forward([&] {
        at::Tensor logits = tf.forward(x);
        return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
      });
      ddp.backward(l);
      const auto order = ddp.last_launch_order();
      const size_t n = ddp.bucket_assignment().size();
      DTRAIN_CHECK(n > 3, "expected several buckets, got {}", n);
      DTRAIN_CHECK(order.size() == n, "launched {} of {} buckets", order.size(), n);
      for (size_t k = 0; k < n; ++k) DTRAIN_CHECK(order[k] == static_cast<int>(k), "order");
      const auto& st = ddp.last_step_stats();
      DTRAIN_CHECK(st.num_collectives == static_cast<int64_t>(n), "stats count");
      int64_t param_bytes = 0;
      for (const auto& p : modules[r]->parameters()) param_bytes += p.numel() * 4;
      DTRAIN_CHECK(st.bytes_communicated == param_bytes, "bytes {} vs {}", st.bytes_communicated,
                   param_bytes);
    }
    std::lock_guard<std::mutex> lock(mu);
    assignments[r] = ddp.bucket_assignment();
  });
  EXPECT_EQ(assignments[0], assignments[1]);
  EXPECT_EQ(assignments[0], assignments[2]);
}

}  // namespace
}  // namespace dtrain

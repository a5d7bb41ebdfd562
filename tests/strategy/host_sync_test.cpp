// A steady-state training step reads nothing on the host on the default path (issue 41): no
// `.item()`, no copy of device memory to the host. On a GPU each such read waits for the
// device's queue to drain, and the GPU then idles while the host queues the next kernels.
//
// Counted on the fake accelerator (support/fake_device.h, HostReads) for SingleDevice,
// DataParallel and FullyShardedDataParallel at 2 ranks, fp32 and bf16, with the gradient
// clipped on the device (clip_grad_norm_tensor) and dtrain::FusedAdamW: forward, backward,
// clip, optimizer step. The communicator stages its calls through host memory (Gloo for the
// fake device, held to NCCL's contract); NCCL does not, so reads made inside a communicator
// call are not counted (UncountedComm). Everything the strategy, the clip and the optimizer
// read is.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/fused_adamw.h"
#include "dtrain/grad_scaler.h"
#include "dtrain/single_device.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/test_models.h"
#include "support/check.h"
#include "support/fake_device.h"
#include "support/nccl_contract.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// A Work whose waiting is the communicator's own business (uncounted).
class UncountedWork final : public Work {
 public:
  explicit UncountedWork(WorkPtr inner) : inner_(std::move(inner)) {}
  bool is_completed() const override { return inner_->is_completed(); }
  void wait(std::chrono::milliseconds timeout) override {
    UncountedHostReads own;
    inner_->wait(timeout);
  }
  void synchronize() override {
    UncountedHostReads own;
    inner_->synchronize();
  }
  std::exception_ptr exception() const override { return inner_->exception(); }
  uint64_t sequence_number() const override { return inner_->sequence_number(); }
  const std::string& op_name() const override { return inner_->op_name(); }

 private:
  WorkPtr inner_;
};

// `inner`'s calls, with the host reads of its staging left uncounted.
class UncountedComm final : public Communicator {
 public:
  explicit UncountedComm(CommunicatorPtr inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Backend backend() const override { return inner_->backend(); }
  const char* transport_name() const override { return inner_->transport_name(); }
  c10::Device device() const override { return inner_->device(); }
  uint64_t sequence_number() const override { return inner_->sequence_number(); }
  WorkPtr all_reduce(at::Tensor t, ReduceOp op, const CallOptions& o) override {
    return run([&] { return inner_->all_reduce(t, op, o); });
  }
  WorkPtr broadcast(at::Tensor t, int root, const CallOptions& o) override {
    return run([&] { return inner_->broadcast(t, root, o); });
  }
  WorkPtr all_gather(at::Tensor out, at::Tensor in, const CallOptions& o) override {
    return run([&] { return inner_->all_gather(out, in, o); });
  }
  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op,
                         const CallOptions& o) override {
    return run([&] { return inner_->reduce_scatter(out, in, op, o); });
  }
  WorkPtr barrier(const CallOptions& o) override {
    return run([&] { return inner_->barrier(o); });
  }
  WorkPtr send(at::Tensor t, int dst, uint32_t tag, const CallOptions& o) override {
    return run([&] { return inner_->send(t, dst, tag, o); });
  }
  WorkPtr recv(at::Tensor t, int src, uint32_t tag, const CallOptions& o) override {
    return run([&] { return inner_->recv(t, src, tag, o); });
  }

 private:
  WorkPtr run(const std::function<WorkPtr()>& call) {
    UncountedHostReads own;
    return std::make_shared<UncountedWork>(call());
  }
  CommunicatorPtr inner_;
};

enum class Kind { kSingle, kDdp, kFsdp };

struct Case {
  Kind kind;
  bool bf16;
  StepChecks checks = StepChecks::kAuto;
  bool grad_scaler = false;  // loss scaling (dtrain::GradScaler over the ranks)
};

constexpr int kWorld = 2;
constexpr int kWarmup = 3;  // DDP rebuilds its buckets after the first iteration
constexpr int kMeasured = 2;
constexpr int64_t kVocab = 32, kCtx = 8, kBatch = 2;

// `plant`, when set, runs inside every measured step (after backward): user code that reads.
using Plant = std::function<void(const at::Tensor& loss)>;

// Host reads per measured step, summed over the ranks.
double host_reads_per_step(const Case& c, const Plant& plant = nullptr) {
  const int world = c.kind == Kind::kSingle ? 1 : kWorld;
  std::vector<std::shared_ptr<TinyTransformerImpl>> models;
  for (int r = 0; r < world; ++r) {
    at::manual_seed(7);  // every rank starts from the same model
    models.push_back(std::make_shared<TinyTransformerImpl>(kVocab, kCtx, 16, 2, 2));
  }
  HostReads before, after;
  auto store = make_memory_store();
  run_threads(world, [&](int r) {
    at::set_num_threads(1);
    const c10::Device device = fake_device(static_cast<c10::DeviceIndex>(r));
    auto model = models[static_cast<size_t>(r)];
    if (c.bf16 && c.kind != Kind::kFsdp) model->to(at::kBFloat16);
    model->to(device);
    std::shared_ptr<Communicator> comm;
    std::shared_ptr<Strategy> s;
    if (c.kind == Kind::kSingle) {
      SingleDeviceOptions o;
      o.device = device;
      s = std::make_shared<SingleDevice>(model, o);
    } else {
      CommunicatorOptions co;
      co.timeout = std::chrono::seconds(30);
      comm = std::make_shared<UncountedComm>(
          make_nccl_contract_communicator(store, r, world, device, co));
      if (c.kind == Kind::kDdp) {
        DataParallelOptions o;
        o.step_checks = c.checks;
        s = std::make_shared<DataParallel>(model, comm, o);
      } else {
        FsdpOptions o;
        o.wrap_policy = blocks_and_nested_up();
        o.step_checks = c.checks;
        if (c.bf16) o.mixed_precision.param_dtype = at::kBFloat16;
        s = std::make_shared<FullyShardedDataParallel>(model, comm, o);
      }
    }
    FusedAdamW opt(s->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    std::optional<GradScaler> scaler;
    if (c.grad_scaler) scaler.emplace(comm);
    at::manual_seed(100 + r);
    const at::Tensor x = at::randint(kVocab, {kBatch, kCtx}, at::kLong).to(device);
    const at::Tensor y = at::randint(kVocab, {kBatch, kCtx}, at::kLong).to(device);
    auto step = [&](bool measured) {
      opt.zero_grad();
      at::Tensor loss = s->forward([&] {
        return at::cross_entropy_loss(model->forward(x).reshape({-1, kVocab}).to(at::kFloat),
                                      y.reshape({-1}));
      });
      s->backward(scaler ? scaler->scale(loss) : loss);
      if (measured && plant) plant(loss);
      if (scaler) scaler->unscale(opt);
      s->clip_grad_norm_tensor(0.1);  // small enough to clip
      if (scaler) {
        scaler->step(opt);
        scaler->update();
      } else {
        opt.step();
      }
    };
    // The readings are taken by rank 0 while every rank waits at a barrier (the barrier's
    // own reads are the communicator's: uncounted).
    auto meet = [&] {
      if (comm) comm->barrier({})->wait();
    };
    for (int i = 0; i < kWarmup; ++i) step(false);
    meet();
    if (r == 0) before = host_reads();
    meet();
    for (int i = 0; i < kMeasured; ++i) step(true);
    meet();
    if (r == 0) after = host_reads();
    meet();
  });
  const HostReads d = after - before;
  if (d.total() != 0) {
    fprintf(stderr, "host reads in %d steps: %lld _local_scalar_dense, %lld device->host copies\n",
            kMeasured, static_cast<long long>(d.local_scalar_dense),
            static_cast<long long>(d.device_to_host_copies));
  }
  return static_cast<double>(d.total()) / kMeasured;
}

std::string name(const Case& c) {
  const char* kinds[] = {"single", "ddp", "fsdp"};
  return fmt::format("{}_{}", kinds[static_cast<int>(c.kind)], c.bf16 ? "bf16" : "fp32");
}

class HostSync : public ::testing::TestWithParam<Case> {};

TEST_P(HostSync, SteadyStateStepReadsNothingOnTheHost) {
  EXPECT_EQ(host_reads_per_step(GetParam()), 0.0) << name(GetParam());
}

// The count sees user code that reads: one `.item()` per rank and step.
TEST_P(HostSync, APlantedItemIsCounted) {
  const Case c = GetParam();
  const double world = c.kind == Kind::kSingle ? 1 : kWorld;
  EXPECT_EQ(host_reads_per_step(c, [](const at::Tensor& loss) { (void)loss.item<float>(); }), world)
      << name(c);
}

INSTANTIATE_TEST_SUITE_P(Strategies, HostSync,
                         ::testing::Values(Case{Kind::kSingle, false}, Case{Kind::kSingle, true},
                                           Case{Kind::kDdp, false}, Case{Kind::kDdp, true},
                                           Case{Kind::kFsdp, false}, Case{Kind::kFsdp, true}),
                         [](const auto& info) { return name(info.param); });

// The debug policy pays for its per-step agreements with host reads: the start and end of
// every step on every rank.
TEST(HostSyncDebug, EveryStepAgreementsReadOnTheHost) {
  EXPECT_GT(host_reads_per_step(Case{Kind::kDdp, false, StepChecks::kEveryStep}), 0.0);
  EXPECT_GT(host_reads_per_step(Case{Kind::kFsdp, false, StepChecks::kEveryStep}), 0.0);
}

// Loss scaling costs one host read per step and rank: whether any rank found inf/NaN, which
// decides on the host whether the optimizer steps (dtrain::FusedAdamW keeps AdamW's host step
// count, so a skipped step cannot be decided on the device). As PyTorch's GradScaler with an
// optimizer other than its fused ones.
TEST(HostSyncGradScaler, OneReadPerStepForTheSkipDecision) {
  for (const Kind kind : {Kind::kSingle, Kind::kDdp, Kind::kFsdp}) {
    const double world = kind == Kind::kSingle ? 1 : kWorld;
    Case c{kind, false};
    c.grad_scaler = true;
    EXPECT_EQ(host_reads_per_step(c), world) << name(c) << " with GradScaler";
  }
}

// clip_grad_norm_tensor() clips as the host clip did (the norm from per-tensor norms summed
// in double on the host, then `if (coef < 1) g.mul_(coef)`): the same gradients bitwise, the
// same norm up to the order of the double sum. bf16 gradients: within one bf16 ulp (2^-7
// relative) of the host clip's, as LibTorch 2.14's CPU foreach multiply rounds some elements
// the other way (seen: 1 ulp, with the same coefficient), and a GPU's rounds the coefficient
// to bf16 first, as PyTorch's own clip does.
TEST(HostSyncClip, DeviceCoefficientClipsAsTheHostOne) {
  for (const bool bf16 : {false, true}) {
    for (const double max_norm : {1e9, 0.05}) {
      std::vector<std::vector<at::Tensor>> grads;
      std::vector<double> norms;
      for (int variant = 0; variant < 2; ++variant) {
        at::manual_seed(7);
        auto model = std::make_shared<TinyTransformerImpl>(kVocab, kCtx, 16, 2, 2);
        if (bf16) model->to(at::kBFloat16);
        SingleDevice s(model);
        at::manual_seed(3);
        const at::Tensor x = at::randint(kVocab, {kBatch, kCtx}, at::kLong);
        s.backward(s.forward([&] { return model->forward(x).to(at::kFloat).square().mean(); }));
        if (variant == 0) {  // the host clip
          double sq = 0;
          for (auto& p : model->parameters()) sq += squared_norm(p.grad());
          const double norm = std::sqrt(sq), coef = max_norm / (norm + 1e-6);
          c10::NoGradGuard no_grad;
          if (coef < 1.0) {
            for (auto& p : model->parameters()) p.mutable_grad().mul_(coef);
          }
          norms.push_back(norm);
        } else {
          norms.push_back(s.clip_grad_norm_tensor(max_norm).item<double>());
        }
        std::vector<at::Tensor> g;
        for (auto& p : model->parameters()) g.push_back(p.grad().clone());
        grads.push_back(g);
      }
      EXPECT_NEAR(norms[0], norms[1], 1e-12 * norms[0]);
      for (size_t i = 0; i < grads[0].size(); ++i) {
        if (bf16) {
          EXPECT_TRUE(
              at::allclose(grads[1][i].to(at::kFloat), grads[0][i].to(at::kFloat), 1.0 / 128, 0))
              << "parameter " << i << " bf16 max_norm " << max_norm;
        } else {
          EXPECT_TRUE(at::equal(grads[0][i], grads[1][i]))
              << "parameter " << i << " fp32 max_norm " << max_norm;
        }
      }
    }
  }
}

}  // namespace
}  // namespace dtrain

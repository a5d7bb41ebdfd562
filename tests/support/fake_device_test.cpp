// The fake device of tests/support/fake_device.h: host code touching its memory dies; ATen on it
// (forward, backward, optimizers, bf16, storage swaps, gradient hooks) gives the CPU's results
// bit for bit; copies to and from the CPU are exact.
#include "support/fake_device.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "compat/foreach.h"
#include "compat/torch_compat.h"
#include "dtrain/fused_adamw.h"

namespace dtrain::testing {
namespace {

// Bitwise equality of a fake tensor with a CPU one: same dtype, sizes and bytes; with
// rtol > 0, equality to that relative tolerance (and rtol / 100 absolute) instead.
void expect_same(const at::Tensor& fake, const at::Tensor& cpu, const std::string& what,
                 double rtol = 0) {
  ASSERT_TRUE(is_fake(fake)) << what << " is on " << fake.device();
  ASSERT_TRUE(cpu.device().is_cpu()) << what;
  ASSERT_EQ(fake.scalar_type(), cpu.scalar_type()) << what;
  ASSERT_EQ(fake.sizes(), cpu.sizes()) << what;
  const at::Tensor back = fake.to(at::kCPU).contiguous();
  const at::Tensor want = cpu.contiguous();
  if (rtol > 0) {
    EXPECT_TRUE(at::allclose(back.to(at::kDouble), want.to(at::kDouble), rtol, rtol / 100))
        << what << ": fake " << back << " cpu " << want;
    return;
  }
  EXPECT_EQ(std::memcmp(back.data_ptr(), want.data_ptr(), want.nbytes()), 0)
      << what << ": fake " << back << " cpu " << want;
}

TEST(FakeDeviceDeathTest, HostAccessToFakeMemoryCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const at::Tensor t = at::ones({64}, at::device(fake_device()));
  ASSERT_EQ(t.device(), fake_device());
  ASSERT_EQ(t.storage().device(), fake_device());
  // The same bytes are readable through the host view: the guarantee below is about the pointer.
  const at::Tensor view = host_view(t);
  std::vector<float> out(64, 0.0f);
  std::memcpy(out.data(), view.data_ptr<float>(), 64 * sizeof(float));
  EXPECT_EQ(out[63], 1.0f);

  EXPECT_DEATH(
      {
        std::memcpy(out.data(), t.data_ptr<float>(), 64 * sizeof(float));
        std::fprintf(stderr, "read %f\n", static_cast<double>(out[5]));
      },
      "");
  EXPECT_DEATH(
      {
        const float* p = t.data_ptr<float>();
        double sum = 0;
        for (int i = 0; i < 64; ++i) sum += p[i];
        std::fprintf(stderr, "sum %f\n", sum);
      },
      "");
  EXPECT_DEATH(
      {
        std::memset(t.storage().data_ptr().get(), 0, t.nbytes());
        std::fprintf(stderr, "wrote\n");
      },
      "");
}

TEST(FakeDevice, DeviceIdentity) {
  ensure_fake_device_registered();
  EXPECT_EQ(fake_device().type(), c10::DeviceType::PrivateUse1);
  EXPECT_EQ(fake_device().index(), 0);
  EXPECT_EQ(c10::Device("privateuseone:0"), fake_device());
  const at::Tensor t = at::zeros({3}, at::device(fake_device()));
  EXPECT_TRUE(is_fake(t));
  EXPECT_FALSE(is_fake(t.to(at::kCPU)));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data_ptr()) & kFakeAddressOffset,
            kFakeAddressOffset);
  EXPECT_THROW(
      at::zeros({3}, at::device(c10::Device(c10::DeviceType::PrivateUse1, kFakeDeviceCount))),
      c10::Error);
  EXPECT_THROW(fake_device(-1), c10::Error);
}

TEST(FakeDevice, SeveralDevices) {
  const at::Tensor cpu = at::arange(10, at::kFloat);
  const at::Tensor on1 = cpu.to(fake_device(1));
  EXPECT_EQ(on1.device(), fake_device(1));
  EXPECT_EQ(on1.storage().device(), fake_device(1));
  const at::Tensor on2 = on1.to(fake_device(2));
  EXPECT_EQ(on2.device(), fake_device(2));
  expect_same(on2, cpu, "device 1 to device 2");
  expect_same(on2 * 2 + on2.sum(), cpu * 2 + cpu.sum(), "ops keep the device");
  EXPECT_EQ((on2 * 2 + on2.sum()).device(), fake_device(2));
  EXPECT_EQ(at::cat({on2, on2}).device(), fake_device(2));
  EXPECT_EQ(compat::storage_allocator(on2).allocate(8).device(), fake_device(2));
  {
    c10::DeviceGuard guard(fake_device(3));
    const at::Tensor current = at::ones({2}, at::device(c10::DeviceType::PrivateUse1));
    EXPECT_EQ(current.device(), fake_device(3));
  }
  EXPECT_EQ(at::ones({2}, at::device(c10::DeviceType::PrivateUse1)).device(), fake_device(0));
}

// Tensors of one operator on different devices fail as they do on CUDA (a CPU tensor handed to
// code that runs on the device is the bug class these tests look for), CPU scalars and CPU
// indices excepted; a Device argument places the result.
TEST(FakeDevice, MixingDevicesFailsAsOnCuda) {
  const at::Tensor f = at::arange(6, at::kFloat).to(fake_device(1));
  EXPECT_THROW(f + at::ones({6}), c10::Error);
  EXPECT_THROW(at::cat({f, at::ones({6})}), c10::Error);
  EXPECT_THROW(f + f.to(fake_device(2)), c10::Error);
  EXPECT_EQ((at::scalar_tensor(2.0) * f).device(), fake_device(1));
  expect_same(at::scalar_tensor(2.0) * f, at::arange(6, at::kFloat) * 2, "CPU scalar first");
  const at::Tensor picked = f.index({at::tensor({0, 2}, at::kLong).to(fake_device(1))});
  expect_same(picked, at::tensor({0.0f, 2.0f}), "index with fake indices");
  expect_same(f.index({at::tensor({1, 5}, at::kLong)}), at::tensor({1.0f, 5.0f}),
              "index with CPU indices");
  const at::Tensor tri = at::tril_indices(3, 3, 0, at::device(fake_device(1)).dtype(at::kLong));
  expect_same(tri, at::tril_indices(3, 3, 0, at::kLong), "tril_indices");
  EXPECT_EQ(tri.device(), fake_device(1));
}

// Ranks as threads, each on its own fake device, whose gradient hooks wait for each other (as
// a collective in a backward hook does): no rank's backward may wait behind another's.
TEST(FakeDevice, RanksOnSeparateDevicesRunBackwardConcurrently) {
  constexpr int kRanks = 4;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        const at::Tensor w = at::ones({4}, at::device(fake_device(rank))).requires_grad_();
        auto accumulator = compat::grad_accumulator(w);
        bool all_arrived = false;
        compat::add_post_hook(accumulator, [&] {
          std::unique_lock<std::mutex> lock(mu);
          ++arrived;
          cv.notify_all();
          all_arrived =
              cv.wait_for(lock, std::chrono::seconds(20), [&] { return arrived == kRanks; });
        });
        (w * w).sum().backward();
        if (!all_arrived) errors[rank] = "the hooks did not run concurrently";
        if (!at::equal(w.grad().to(at::kCPU), at::full({4}, 2.0f))) errors[rank] = "wrong gradient";
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < kRanks; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

TEST(FakeDevice, RoundTripsAreExact) {
  const auto source = at::linspace(-1000.0, 1000.0, 97, at::kDouble).mul(1.37).reshape({97});
  for (const auto dtype :
       {at::kFloat, at::kDouble, at::kBFloat16, at::kLong, at::kByte, at::kBool}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor cpu = dtype == at::kByte   ? source.abs().remainder(256).to(dtype)
                           : dtype == at::kBool ? source.gt(0.5)
                                                : source.to(dtype);
    const at::Tensor fake = cpu.to(fake_device());
    expect_same(fake, cpu, "to(fake)");
    EXPECT_TRUE(at::equal(fake.to(at::kCPU), cpu));
    // Non-contiguous in both directions, and copy_ into existing tensors.
    const at::Tensor strided_cpu = cpu.narrow(0, 1, 96).view({8, 12}).t();
    const at::Tensor strided_fake = fake.narrow(0, 1, 96).view({8, 12}).t();
    expect_same(strided_fake, strided_cpu, "strided view");
    at::Tensor into_cpu = at::empty({12, 8}, at::dtype(dtype));
    into_cpu.copy_(strided_fake);
    EXPECT_TRUE(at::equal(into_cpu, strided_cpu));
    at::Tensor into_fake = at::zeros({12, 8}, at::device(fake_device()).dtype(dtype)).t();
    into_fake.copy_(strided_cpu.t());
    expect_same(into_fake, strided_cpu.t(), "copy_ into a strided fake tensor");
    expect_same(fake.clone(), cpu, "clone");
  }
}

// The elementwise, reduction and shape operations the strategies and optimizers use, on fake
// and CPU tensors of `dtype`, compared bitwise.
void check_ops(at::ScalarType dtype) {
  const auto fake = at::device(fake_device()).dtype(dtype);
  const auto cpu = at::dtype(dtype);
  const at::Tensor a_cpu = at::linspace(-3, 3, 24, at::kFloat).reshape({2, 3, 4}).to(dtype);
  const at::Tensor b_cpu = at::linspace(0.5, 2, 24, at::kFloat).reshape({2, 4, 3}).to(dtype);
  const at::Tensor a = a_cpu.to(fake_device());
  const at::Tensor b = b_cpu.to(fake_device());
  const auto both = [&](const char* what,
                        const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& f) {
    expect_same(f(a, b), f(a_cpu, b_cpu), what);
  };
  both("matmul", [](auto x, auto y) { return at::matmul(x, y); });
  both("bmm", [](auto x, auto y) { return at::bmm(x, y); });
  both("softmax", [](auto x, auto) { return at::softmax(x, -1); });
  both("log_softmax", [](auto x, auto) { return at::log_softmax(x, 1); });
  both("sum", [](auto x, auto) { return x.sum(); });
  both("sum dim", [](auto x, auto) { return x.sum(at::IntArrayRef{0, 2}); });
  both("mean", [](auto x, auto) { return x.mean(); });
  both("norm", [](auto x, auto) { return x.norm(); });
  both("norm float", [](auto x, auto) { return x.to(at::kFloat).norm(2); });
  both("cat", [](auto x, auto y) { return at::cat({x, y.transpose(1, 2)}, 1); });
  both("stack", [](auto x, auto y) { return at::stack({x.flatten(), y.flatten()}); });
  both("narrow/select/slice",
       [](auto x, auto) { return x.narrow(2, 1, 2).select(0, 1).slice(0, 1, 3).contiguous(); });
  both("view/reshape", [](auto x, auto y) { return x.view({6, 4}) + y.reshape({6, 4}); });
  both("index_select", [](auto x, auto) {
    return x.index_select(2, at::arange(3, 0, -1, x.options().dtype(at::kLong)));
  });
  both("gelu/relu", [](auto x, auto) { return at::relu(at::gelu(x)); });
  both("dropout p=0", [](auto x, auto) { return at::dropout(x, 0.0, /*train=*/true); });
  both("sqrt", [](auto, auto y) { return y.sqrt(); });
  both("to(double)", [](auto x, auto) { return x.to(at::kDouble); });
  both("isfinite/all/any", [](auto x, auto y) {
    const at::Tensor z = x / (y.reshape({2, 3, 4}) - 1);
    return at::stack({z.isfinite().all(), z.isinf().any(), z.isfinite().any()});
  });
  both("in place", [](auto x, auto y) {
    at::Tensor t = x.clone();
    t.add_(y.reshape({2, 3, 4}), 0.5).mul_(1.25).div_(y.reshape({2, 3, 4}));
    t.addcmul_(x, x, 0.1).addcdiv_(x, y.reshape({2, 3, 4}), -0.2);
    t.lerp_(x, 0.3);
    t.narrow(1, 0, 1).fill_(7).add_(1);
    t.select(2, 3).zero_();
    return t;
  });
  both("copy_ between dtypes", [](auto x, auto) {
    at::Tensor t = at::empty(x.sizes(), x.options().dtype(at::kDouble));
    return t.copy_(x);
  });
  both("cross_entropy/nll_loss", [](auto x, auto) {
    const at::Tensor logits = x.reshape({6, 4});
    const at::Tensor target = at::arange(6, logits.options().dtype(at::kLong)).remainder(4);
    return at::stack(
        {at::cross_entropy_loss(logits, target), at::nll_loss(at::log_softmax(logits, 1), target)});
  });
  // Factories.
  expect_same(at::zeros({5}, fake), at::zeros({5}, cpu), "zeros");
  expect_same(at::ones({5}, fake), at::ones({5}, cpu), "ones");
  expect_same(at::full({2, 2}, 3.5, fake), at::full({2, 2}, 3.5, cpu), "full");
  expect_same(at::arange(1, 9, 2, fake), at::arange(1, 9, 2, cpu), "arange");
  EXPECT_EQ(at::empty({4, 5}, fake).sizes(), at::IntArrayRef({4, 5}));
  // Scalars back to the host.
  EXPECT_EQ(a.sum().item<double>(), a_cpu.sum().item<double>());
  EXPECT_EQ(a.norm().item<float>(), a_cpu.norm().item<float>());
  EXPECT_TRUE(a.isfinite().all().item<bool>());
}

TEST(FakeDevice, OperationsMatchTheCpuFloat) { check_ops(at::kFloat); }
TEST(FakeDevice, OperationsMatchTheCpuBFloat16) { check_ops(at::kBFloat16); }

constexpr int64_t kVocab = 11, kDim = 8, kHidden = 16;

// Embedding, layer norm, an attention-like bmm, an MLP with GELU/ReLU/dropout(0), a head.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : emb(register_module("emb", torch::nn::Embedding(kVocab, kDim))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", torch::nn::Linear(kDim, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kDim))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {}

  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = norm(emb(tokens));
    const at::Tensor scores = at::matmul(x, x.transpose(1, 2)) / std::sqrt(double(kDim));
    x = x + at::bmm(at::softmax(scores, -1), x);
    const at::Tensor h = at::dropout(at::gelu(fc1(x)), 0.0, is_training());
    x = x + fc2(at::relu(h));
    return head(x);
  }

  torch::nn::Embedding emb;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(Net);

// A second net with the first's parameters, on `device`.
Net copy_of(const Net& from, c10::Device device) {
  Net to;
  to->to(from->parameters().front().scalar_type());
  {
    at::NoGradGuard no_grad;
    const auto src = from->parameters();
    auto dst = to->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  to->to(device);
  return to;
}

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

// Trains a CPU and a fake copy of one net for `steps` steps and compares the loss, every
// gradient and every parameter bitwise after each (to `rtol` when it is positive).
// `make_cpu` makes the CPU net's optimizer when given, `make` the fake one's (and the CPU one's
// otherwise).
void train_both(const MakeOptimizer& make, int steps, at::ScalarType dtype = at::kFloat,
                const MakeOptimizer& make_cpu = nullptr, double rtol = 0) {
  Net cpu;
  cpu->to(dtype);
  Net fake = copy_of(cpu, fake_device());
  ASSERT_EQ(fake->parameters().size(), cpu->parameters().size());
  for (const auto& p : fake->parameters()) ASSERT_TRUE(is_fake(p));
  auto opt_cpu = (make_cpu ? make_cpu : make)(cpu->parameters());
  auto opt_fake = make(fake->parameters());
  const at::Tensor tokens = at::arange(24, at::kLong).mul(7).remainder(kVocab).reshape({3, 8});
  const at::Tensor targets = tokens.roll(1, 1);
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto loss_of = [&](Net& net, const at::Tensor& x, const at::Tensor& y) {
      return at::cross_entropy_loss(net->forward(x).flatten(0, 1), y.flatten());
    };
    opt_cpu->zero_grad();
    opt_fake->zero_grad();
    const at::Tensor loss_cpu = loss_of(cpu, tokens, targets);
    const at::Tensor loss_fake = loss_of(fake, tokens.to(fake_device()), targets.to(fake_device()));
    expect_same(loss_fake, loss_cpu, "loss", rtol);
    loss_cpu.backward();
    loss_fake.backward();
    const auto pc = cpu->named_parameters();
    const auto pf = fake->named_parameters();
    for (const auto& item : pc) {
      ASSERT_TRUE(pf[item.key()].grad().defined()) << item.key();
      expect_same(pf[item.key()].grad(), item.value().grad(), item.key() + ".grad", rtol);
    }
    opt_cpu->step();
    opt_fake->step();
    for (const auto& item : pc) expect_same(pf[item.key()], item.value(), item.key(), rtol);
  }
}

// The in-place foreach operators (a written list, nothing returned) change the fake tensors
// as they change CPU ones: LibTorch 1.13's CPU fallback alone would leave them unchanged.
TEST(FakeDevice, InPlaceForeachOperatorsWriteTheDeviceTensors) {
  const at::Tensor a = at::randn({5}), b = at::randn({3, 2});
  std::vector<at::Tensor> cpu = {a.clone(), b.clone()};
  std::vector<at::Tensor> fake = {a.to(fake_device()), b.to(fake_device())};
  const std::vector<at::Tensor> other_cpu = {a.mul(2), b.mul(3)};
  const std::vector<at::Tensor> other = {other_cpu[0].to(fake_device()),
                                         other_cpu[1].to(fake_device())};
  at::_foreach_mul_(cpu, 1.5);
  at::_foreach_mul_(fake, 1.5);
  at::_foreach_add_(cpu, other_cpu, 0.25);
  at::_foreach_add_(fake, other, 0.25);
  at::_foreach_addcdiv_(cpu, other_cpu, other_cpu, -0.5);
  at::_foreach_addcdiv_(fake, other, other, -0.5);
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_TRUE(is_fake(fake[i]));
    EXPECT_TRUE(at::equal(fake[i].to(at::kCPU), cpu[i])) << "tensor " << i;
    EXPECT_FALSE(at::equal(cpu[i], i == 0 ? a : b)) << "the operators changed nothing";
  }
}

TEST(FakeDevice, TrainingMatchesTheCpuWithSgd) {
  train_both(
      [](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(
            std::move(p), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
      },
      3);
}

TEST(FakeDevice, TrainingMatchesTheCpuWithAdamW) {
  train_both(
      [](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(std::move(p),
                                                     torch::optim::AdamWOptions(0.01));
      },
      3);
}

// FusedAdamW runs its own loop on contiguous CPU tensors and multi-tensor ATen operations on
// an accelerator's: the fake net takes the second path (host loops there would crash) and
// trains as LibTorch's AdamW on the CPU does.
TEST(FakeDevice, TrainingWithFusedAdamWMatchesAdamWOnTheCpu) {
  train_both(
      [](std::vector<at::Tensor> p) {
        return std::make_unique<dtrain::FusedAdamW>(std::move(p), torch::optim::AdamWOptions(0.01));
      },
      3, at::kFloat,
      [](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(std::move(p),
                                                     torch::optim::AdamWOptions(0.01));
      },
      // On a device FusedAdamW runs LibTorch's fused kernel where it has one (2.4+): AdamW's
      // results to float rounding; before that AdamW's own operations, bitwise.
      compat::kFusedAdamWKernel ? 1e-4 : 0);
}

TEST(FakeDevice, TrainingMatchesTheCpuInBFloat16) {
  train_both(
      [](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(std::move(p),
                                                   torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      2, at::kBFloat16);
}

TEST(FakeDevice, GradientHooksAndGradMode) {
  Net fake = copy_of(Net(), fake_device());
  const at::Tensor weight = fake->fc1->weight;
  auto accumulator = compat::grad_accumulator(weight);
  std::vector<at::Tensor> seen;  // the gradient each time the hook fired
  compat::add_post_hook(accumulator, [&] { seen.push_back(weight.grad().clone()); });
  const at::Tensor tokens = at::arange(8, at::kLong).reshape({1, 8}).to(fake_device());
  {
    at::NoGradGuard no_grad;
    EXPECT_FALSE(fake->forward(tokens).requires_grad());
  }
  EXPECT_TRUE(at::GradMode::is_enabled());
  fake->forward(tokens).sum().backward();
  ASSERT_EQ(seen.size(), 1u);
  ASSERT_TRUE(is_fake(seen[0]));
  EXPECT_TRUE(at::equal(seen[0].to(at::kCPU), weight.grad().to(at::kCPU)));
  // A second backward accumulates (add_ into the existing fake gradient): exactly doubled.
  fake->forward(tokens).sum().backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(at::equal(seen[1].to(at::kCPU), seen[0].to(at::kCPU).mul(2)));
  EXPECT_TRUE(at::equal(weight.grad().to(at::kCPU), seen[1].to(at::kCPU)));
}

// The storage swap FSDP does (compat::take_storage / fill_storage with the storage's own
// allocator), with autograd's saved tensors seeing the refilled memory.
TEST(FakeDevice, StorageCanBeReleasedAndRefilled) {
  const at::Tensor cpu_w = at::linspace(-1, 1, 12, at::kFloat).reshape({3, 4});
  const at::Tensor w = cpu_w.to(fake_device()).requires_grad_();
  const at::Tensor x = at::ones({2, 3}, at::device(fake_device())).requires_grad_();
  const at::Tensor y = at::matmul(x, w);  // saves w for x's gradient
  const size_t nbytes = w.storage().nbytes();
  EXPECT_EQ(nbytes, 12 * sizeof(float));

  at::DataPtr taken = compat::take_storage(w);
  EXPECT_TRUE(compat::storage_is_released(w));
  EXPECT_EQ(taken.device(), fake_device());
  c10::Allocator& allocator = compat::storage_allocator(w);
  at::DataPtr fresh = allocator.allocate(nbytes);
  EXPECT_EQ(fresh.device(), fake_device());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(fresh.get()) & kFakeAddressOffset, kFakeAddressOffset);
  compat::fill_storage(w, std::move(fresh), nbytes);
  {
    at::NoGradGuard no_grad;
    w.data().copy_(cpu_w * 2);  // ATen copy, version counter untouched (as FSDP does)
  }
  y.sum().backward();
  // x's gradient is 1 w^T, read from the refilled (doubled) storage.
  expect_same(x.grad(), at::matmul(at::ones({2, 4}), (cpu_w * 2).t()), "x.grad");
  expect_same(w.grad(), at::ones({3, 4}) * 2, "w.grad");
  expect_same(w.detach().clone(), cpu_w * 2, "refilled w");

  // set_ onto another tensor's storage (DDP's bucket views, FSDP's flat parameter).
  const at::Tensor flat = at::arange(20, at::device(fake_device()).dtype(at::kFloat));
  at::Tensor part = at::empty({0}, flat.options());
  part.set_(flat.storage(), 5, {2, 3}, {3, 1});
  expect_same(part, at::arange(5, 11, at::kFloat).reshape({2, 3}), "set_ view");
  part.mul_(-1);
  EXPECT_EQ(flat[7].item<float>(), -7.0f);
  // Growing a fake tensor keeps its contents.
  at::Tensor grow = at::arange(4, at::device(fake_device()).dtype(at::kFloat));
  grow.resize_({10});
  expect_same(grow.narrow(0, 0, 4), at::arange(4, at::kFloat), "resize_ keeps contents");
}

}  // namespace
}  // namespace dtrain::testing

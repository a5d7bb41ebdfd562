// fused_lm_loss against the unfused reference (logits, then cross_entropy, autograd through
// both): loss and the gradients reaching hidden (through an upstream op) and the weight.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>

#include "dtrain/autocast.h"
#include "dtrain/errors.h"
#include "lm_head_loss.h"
#include "model.h"

namespace gpt2 {
namespace {

struct Grads {
  at::Tensor loss, upstream, weight;
};

// hidden = x @ a (so hidden's gradient is checked through a's), logits = hidden @ w^T.
Grads run(bool fused, const at::Tensor& x, const at::Tensor& a0, const at::Tensor& w0,
          const at::Tensor& targets, int64_t chunk, double scale = 1.0) {
  at::Tensor a = a0.clone().requires_grad_(true);
  at::Tensor w = w0.clone().requires_grad_(true);
  at::Tensor hidden = at::matmul(x, a);
  at::Tensor loss =
      fused ? fused_lm_loss(hidden, w, targets, chunk) : lm_loss(at::linear(hidden, w), targets);
  (loss * scale).backward();
  return {loss.detach(), a.grad(), w.grad()};
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol, double atol,
                  const char* what) {
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  const double bound = atol + rtol * want.to(at::kDouble).abs().max().item<double>();
  EXPECT_LE(err, bound) << what << ": max abs difference " << err;
}

// (chunk rows, seed of backward, hidden size D). With 39 rows, D = 24 computes the weight's
// gradient in forward; D = 48 (rows <= D) keeps the logits' gradient for backward instead.
class FusedLmLoss : public ::testing::TestWithParam<std::tuple<int64_t, double, int64_t>> {};

TEST_P(FusedLmLoss, MatchesUnfusedLossAndGradients) {
  const auto [chunk, scale, D] = GetParam();
  at::manual_seed(3);
  const int64_t B = 3, T = 13, V = 101;  // 39 rows: chunks of 8 leave 7
  at::Tensor x = at::randn({B, T, D});
  at::Tensor a = at::randn({D, D}) * 0.3;
  at::Tensor w = at::randn({V, D}) * 0.5;
  at::Tensor targets = at::randint(V, {B, T}, at::kLong);
  Grads ref = run(false, x, a, w, targets, 0, scale);
  Grads got = run(true, x, a, w, targets, chunk, scale);
  EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
  EXPECT_EQ(got.loss.dim(), 0);
  expect_close(got.loss, ref.loss, 1e-6, 0, "loss");
  expect_close(got.upstream, ref.upstream, 1e-5, 1e-7, "gradient through hidden");
  expect_close(got.weight, ref.weight, 1e-5, 1e-7, "weight gradient");
}

INSTANTIATE_TEST_SUITE_P(ChunksAndSeeds, FusedLmLoss,
                         ::testing::Combine(::testing::Values(int64_t{0}, int64_t{8},
                                                              int64_t{1}),  // 1, 5, 39 chunks
                                            ::testing::Values(1.0, 2.5),    // seed != 1
                                            ::testing::Values(int64_t{24}, int64_t{48})),
                         [](const auto& info) {
                           return "chunk" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == 1.0 ? "" : "_scaled") +
                                  (std::get<2>(info.param) == 48 ? "_weight_grad_in_backward" : "");
                         });

// A weight that needs no gradient (frozen embedding): only hidden's, which matches.
TEST(FusedLmLossFrozenWeight, OnlyTheHiddenGradient) {
  at::manual_seed(6);
  at::Tensor x = at::randn({5, 12});
  at::Tensor a0 = at::randn({12, 12}) * 0.3;
  at::Tensor w = at::randn({40, 12});
  at::Tensor t = at::randint(40, {5}, at::kLong);
  at::Tensor grads[2];
  for (int fused = 0; fused < 2; ++fused) {
    at::Tensor a = a0.clone().requires_grad_(true);
    at::Tensor hidden = at::matmul(x, a);
    (fused ? fused_lm_loss(hidden, w, t, 2) : lm_loss(at::linear(hidden, w), t)).backward();
    grads[fused] = a.grad();
  }
  EXPECT_FALSE(w.grad().defined());
  expect_close(grads[1], grads[0], 1e-5, 1e-7, "gradient through hidden");
}

TEST(FusedLmLossNoGrad, LossOnlyAndSameValue) {
  at::manual_seed(4);
  at::Tensor h = at::randn({20, 16});
  at::Tensor w = at::randn({50, 16}).requires_grad_(true);
  at::Tensor t = at::randint(50, {20}, at::kLong);
  at::Tensor want = lm_loss(at::linear(h, w), t).detach();
  at::NoGradGuard no_grad;
  at::Tensor got = fused_lm_loss(h, w, t, 7);
  EXPECT_FALSE(got.requires_grad());
  expect_close(got, want, 1e-6, 0, "loss");
}

// A target whose probability underflows fp32 (logit 200 below the row's largest): the loss
// must stay finite and exact, from the logits instead of log(0). D = 1 and (zero-padded) 3:
// the weight's gradient formed in forward and in backward.
class FusedLmLossUnderflow : public ::testing::TestWithParam<int64_t> {};

TEST_P(FusedLmLossUnderflow, ExactLossWhenTargetProbabilityUnderflows) {
  const int64_t D = GetParam();
  at::Tensor h = at::constant_pad_nd(at::tensor({1.0f, 1.0f, -1.0f}).view({3, 1}), {0, D - 1});
  at::Tensor w = at::constant_pad_nd(at::tensor({200.0f, 0.0f, 0.5f}).view({3, 1}), {0, D - 1});
  at::Tensor t =
      at::tensor({int64_t{1}, int64_t{0}, int64_t{2}});  // row 0: p = exp(-200) = 0 in fp32
  Grads ref = run(false, h, at::eye(D), w, t, 0);
  Grads got = run(true, h, at::eye(D), w, t, 2);
  ASSERT_TRUE(std::isfinite(got.loss.item<double>()));
  expect_close(got.loss, ref.loss, 1e-6, 0, "loss");
  expect_close(got.weight, ref.weight, 1e-5, 1e-7, "weight gradient");
}

INSTANTIATE_TEST_SUITE_P(HiddenSizes, FusedLmLossUnderflow,
                         ::testing::Values(int64_t{1}, int64_t{3}),
                         [](const auto& info) { return "D" + std::to_string(info.param); });

// 18 rows; D = 32 keeps the logits' gradient for backward, D = 8 forms the weight's in forward.
class FusedLmLossBf16 : public ::testing::TestWithParam<int64_t> {};

TEST_P(FusedLmLossBf16, CloseToUnfusedInBf16) {
  const int64_t D = GetParam();
  at::manual_seed(5);
  at::Tensor x = at::randn({2, 9, D}).to(at::kBFloat16);
  at::Tensor a = (at::randn({D, D}) * 0.2).to(at::kBFloat16);
  at::Tensor w = (at::randn({77, D}) * 0.5).to(at::kBFloat16);
  at::Tensor t = at::randint(77, {2, 9}, at::kLong);
  Grads ref = run(false, x, a, w, t, 0);
  Grads got = run(true, x, a, w, t, 4);
  EXPECT_EQ(got.weight.scalar_type(), at::kBFloat16);
  // bf16 keeps 8 bits of mantissa; the fused path accumulates the weight gradient in fp32.
  expect_close(got.loss, ref.loss, 1e-3, 0, "loss");
  expect_close(got.upstream, ref.upstream, 2e-2, 1e-3, "gradient through hidden");
  expect_close(got.weight, ref.weight, 2e-2, 1e-3, "weight gradient");
}

INSTANTIATE_TEST_SUITE_P(HiddenSizes, FusedLmLossBf16, ::testing::Values(int64_t{32}, int64_t{8}),
                         [](const auto& info) { return "D" + std::to_string(info.param); });

TEST(FusedLmLossArgs, SecondBackwardThroughTheSameLossIsAnError) {
  at::Tensor h = at::randn({4, 8}).requires_grad_(true);
  at::Tensor w = at::randn({10, 8}).requires_grad_(true);
  at::Tensor loss = fused_lm_loss(h, w, at::zeros({4}, at::kLong));
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
    FAIL() << "second backward did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("twice"), std::string::npos) << e.what();
  }
}

TEST(FusedLmLossArgs, RejectsMismatchedShapes) {
  at::Tensor h = at::randn({4, 8});
  at::Tensor w = at::randn({10, 8});
  EXPECT_THROW(fused_lm_loss(h, at::randn({10, 7}), at::zeros({4}, at::kLong)),
               dtrain::InvalidArgument);
  EXPECT_THROW(fused_lm_loss(h, w, at::zeros({5}, at::kLong)), dtrain::InvalidArgument);
  EXPECT_THROW(fused_lm_loss(h, w, at::zeros({4}, at::kInt)), dtrain::InvalidArgument);
  EXPECT_THROW(fused_lm_loss(h, w.to(at::kDouble), at::zeros({4}, at::kLong)),
               dtrain::InvalidArgument);
  EXPECT_THROW(fused_lm_loss(h, w, at::zeros({4}, at::kLong), -1), dtrain::InvalidArgument);
  EXPECT_THROW(fused_lm_loss(h, w, at::zeros({4}, at::kLong), 0, at::kLong),
               dtrain::InvalidArgument);
}

// fp32 inputs with bf16 matmuls (what autocast selects on a GPU): the loss and gradients of
// the unfused loss whose linear runs on bf16 copies, within bf16's rounding. (D, chunk): the
// weight's gradient in forward (D = 24, chunks of 8 leave 7) or from the kept logits' (D = 48).
class FusedLmLossBf16Matmuls : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(FusedLmLossBf16Matmuls, CloseToTheUnfusedLossOnBf16Copies) {
  const auto [D, chunk] = GetParam();
  at::manual_seed(5);
  const int64_t N = 39, V = 101;
  at::Tensor h0 = at::randn({N, D});
  at::Tensor w0 = at::randn({V, D}) * 0.5;
  at::Tensor t = at::randint(V, {N}, at::kLong);
  at::Tensor h_ref = h0.clone().requires_grad_(true);
  at::Tensor w_ref = w0.clone().requires_grad_(true);
  at::Tensor ref = lm_loss(at::linear(h_ref.to(at::kBFloat16), w_ref.to(at::kBFloat16)), t);
  ref.backward();
  at::Tensor h = h0.clone().requires_grad_(true);
  at::Tensor w = w0.clone().requires_grad_(true);
  at::Tensor got = fused_lm_loss(h, w, t, chunk, at::kBFloat16);
  got.backward();
  EXPECT_EQ(h.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
  expect_close(got, ref, 1e-5, 0, "loss");
  expect_close(h.grad(), h_ref.grad(), 2e-2, 1e-6, "hidden gradient");
  expect_close(w.grad(), w_ref.grad(), 2e-2, 1e-6, "weight gradient");
  // The matmuls really ran in bf16: the fp32 pass gives another loss.
  const at::Tensor fp32 = fused_lm_loss(h0, w0, t, chunk);
  EXPECT_GT((fp32 - got.detach()).abs().item<double>(), 1e-7);
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedLmLossBf16Matmuls,
                         ::testing::Values(std::make_tuple(int64_t{24}, int64_t{8}),
                                           std::make_tuple(int64_t{48}, int64_t{0})));

// CPU autocast leaves the fused loss's matmuls in fp32: bit for bit the same as without it.
TEST(FusedLmLossAutocast, CpuMatmulsStayFp32) {
  at::manual_seed(6);
  at::Tensor h = at::randn({20, 16});
  at::Tensor w = at::randn({50, 16});
  at::Tensor t = at::randint(50, {20}, at::kLong);
  const at::Tensor plain = fused_lm_loss(h, w, t);
  at::Tensor in_region;
  {
    dtrain::AutocastGuard guard(dtrain::Autocast(c10::DeviceType::CPU, at::kBFloat16));
    ASSERT_EQ(dtrain::autocast_dtype(c10::DeviceType::CPU), at::kBFloat16);
    in_region = fused_lm_loss(h, w, t);
  }
  EXPECT_FALSE(dtrain::autocast_dtype(c10::DeviceType::CPU).has_value());
  EXPECT_TRUE(at::equal(plain, in_region));
}

}  // namespace
}  // namespace gpt2

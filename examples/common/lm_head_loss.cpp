#include "lm_head_loss.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "dtrain/autocast.h"
#include "dtrain/errors.h"

namespace gpt2 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Bigger chunks make the three matmuls per chunk more efficient (the weight-gradient one
// has the chunk's rows as its inner dimension) at the cost of a bigger buffer.
constexpr int64_t kChunkBytes = int64_t{128} << 20;
// Below this a probability is treated as underflowed (FLT_MIN is 1.2e-38).
constexpr float kTiny = 1e-30f;

// What a pass computes besides the loss.
enum class Grads {
  kNone,
  // d loss / d hidden and d loss / d weight, in forward.
  kBoth,
  // d loss / d hidden in forward; for the weight, the logits' gradient [N, V] is kept and
  // multiplied out in backward. Chosen when N <= D: the kept gradient is then no larger than
  // the weight's, and the [V, D] weight gradient exists only from backward on (under FSDP
  // the weight's unit is freed by then, docs/benchmarks-history.md "FSDP's tied embedding").
  kHiddenNowWeightLater,
  // d loss / d hidden only (the weight needs none).
  kHidden,
};

struct Pass {
  at::Tensor loss;         // fp32 scalar
  at::Tensor grad_hidden;  // [N, D] in hidden's dtype, d loss / d hidden; undefined if not asked
  at::Tensor grad_weight;  // [V, D] in weight's dtype (kBoth)
  at::Tensor grad_logits;  // [N, V] fp32, d loss / d logits times N (kHiddenNowWeightLater)
};

// The chunk's summed loss (double), its logits z turned into their softmax in place. One exp
// per logit: the softmax in place (row max, exp and sum, scale, each row while it is in
// cache; every element is read before it is written), and the loss from it as -log p[target].
// A second buffer for p would cost its page faults and 128 MiB. Where p[target] underflows
// (the target's logit more than ~87 below the row's largest), that row's loss is computed
// exactly as logsumexp - logit, from its logits formed again by `fp32_logits_of_rows` (rare:
// a small matmul of those rows only).
template <typename LogitsOfRows>
at::Tensor softmax_in_place_and_loss(at::Tensor& z, const at::Tensor& tc,
                                     const LogitsOfRows& fp32_logits_of_rows) {
  at::_softmax_out(z, z, 1, false);
  at::Tensor pt = z.gather(1, tc).squeeze(1);
  at::Tensor row_loss = pt.clamp_min(kTiny).log_().neg_();
  at::Tensor tiny_rows = (pt < kTiny).nonzero().squeeze(1);
  if (tiny_rows.numel() > 0) {
    at::Tensor zr = fp32_logits_of_rows(tiny_rows);
    row_loss.index_copy_(
        0, tiny_rows,
        at::logsumexp(zr, 1) - zr.gather(1, tc.index_select(0, tiny_rows)).squeeze(1));
  }
  return row_loss.sum(at::kDouble);
}

// run_chunks with every matmul in `mm`: autocast's bf16/fp16 for fp32 inputs, or low-precision
// inputs' own dtype on a GPU. There an fp32 matmul runs without tensor cores (LibTorch leaves
// TF32 off), several times slower than bf16, and these three are the largest of a GPT-2
// step: under autocast they follow it, as at::linear's do. The weight's gradient is
// accumulated over the chunks in fp32.
Pass run_chunks_cast(const at::Tensor& h, const at::Tensor& w, const at::Tensor& t, int64_t chunk,
                     Grads grads, c10::ScalarType mm) {
  const int64_t N = h.size(0);
  const int64_t V = w.size(0);
  const double inv_n = 1.0 / static_cast<double>(N);
  const auto f32 = h.options().dtype(at::kFloat);
  const int64_t rows = std::min(chunk, N);
  const at::Tensor hm = h.to(mm);
  const at::Tensor wm = w.to(mm);
  const at::Tensor wm_t = wm.t();
  const bool keep_logit_grads = grads == Grads::kHiddenNowWeightLater;
  at::Tensor logits_buf = at::empty({keep_logit_grads ? N : rows, V}, f32);
  at::Tensor loss_sum = at::zeros({}, h.options().dtype(at::kDouble));
  Pass out;
  at::Tensor grad_w32;
  if (grads != Grads::kNone) out.grad_hidden = at::empty_like(h);
  if (grads == Grads::kBoth) grad_w32 = at::zeros({V, w.size(1)}, f32);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t c = std::min(rows, N - r0);
    at::Tensor hc = hm.narrow(0, r0, c);
    at::Tensor tc = t.narrow(0, r0, c).unsqueeze(1);
    at::Tensor z = logits_buf.narrow(0, keep_logit_grads ? r0 : 0, c);
    z.copy_(at::mm(hc, wm_t));
    loss_sum.add_(softmax_in_place_and_loss(z, tc, [&](const at::Tensor& rows_idx) {
      return at::mm(hc.index_select(0, rows_idx), wm_t).to(at::kFloat);
    }));
    if (grads == Grads::kNone) continue;
    z.scatter_add_(1, tc, at::full({c, 1}, -1.0f, f32));
    if (keep_logit_grads) {  // the weight's gradient is formed from z in backward
      out.grad_hidden.narrow(0, r0, c).copy_(at::mm(z.to(mm), wm).mul_(inv_n));
      continue;
    }
    const at::Tensor dz = z.to(mm);
    out.grad_hidden.narrow(0, r0, c).copy_(at::mm(dz, wm).mul_(inv_n));
    if (grads == Grads::kBoth) grad_w32.add_(at::mm(dz.t(), hc), inv_n);
  }
  out.loss = loss_sum.mul_(inv_n).to(at::kFloat);
  if (grads == Grads::kBoth) out.grad_weight = grad_w32.to(w.scalar_type());
  if (keep_logit_grads) out.grad_logits = logits_buf;
  return out;
}

// One pass over the rows of h [N, D] in chunks, with the gradients `grads` asks for, each
// chunk's while its logits are at hand.
// `mm` is the dtype of the three matmuls: the inputs' own, or autocast's (below), in which
// case every matmul runs on copies of h and w in that dtype and only the softmax, the loss
// and the weight's gradient accumulation stay in fp32.
Pass run_chunks(const at::Tensor& h, const at::Tensor& w, const at::Tensor& t, int64_t chunk,
                Grads grads, c10::ScalarType mm) {
  const int64_t N = h.size(0);
  const int64_t V = w.size(0);
  const double inv_n = 1.0 / static_cast<double>(N);
  // On a GPU a low-precision pass takes the cast path too: its weight-gradient matmul (fp32
  // below, for the CPU's sake) would run without tensor cores.
  if (mm != h.scalar_type() || (mm != at::kFloat && !h.is_cpu())) {
    return run_chunks_cast(h, w, t, chunk, grads, mm);
  }
  const bool fp32 = h.scalar_type() == at::kFloat;
  const auto f32 = h.options().dtype(at::kFloat);
  const int64_t rows = std::min(chunk, N);
  // One buffer for every chunk: the logits, overwritten in place by their softmax, then by
  // the logits' gradient. A fresh [rows, V] tensor per chunk would fault in every page. It is
  // freed on return: kept between steps it bought no measurable speed and sat in FSDP's peak
  // (docs/benchmarks-history.md, "The fused loss's buffers"). When the logits' gradient is
  // kept, every row has its own.
  const bool keep_logit_grads = grads == Grads::kHiddenNowWeightLater;
  at::Tensor logits_buf = at::empty({keep_logit_grads ? N : rows, V}, f32);
  at::Tensor w_t = w.t();
  at::Tensor loss_sum = at::zeros({}, h.options().dtype(at::kDouble));
  Pass out;
  at::Tensor grad_w32;
  if (grads != Grads::kNone) out.grad_hidden = at::empty_like(h);
  if (grads == Grads::kBoth) grad_w32 = at::zeros({V, w.size(1)}, f32);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t c = std::min(rows, N - r0);
    at::Tensor hc = h.narrow(0, r0, c);
    at::Tensor tc = t.narrow(0, r0, c).unsqueeze(1);
    at::Tensor z = logits_buf.narrow(0, keep_logit_grads ? r0 : 0, c);
    auto logits_of = [&](const at::Tensor& rows_h, at::Tensor out) {
      if (fp32) {
        at::mm_out(out, rows_h, w_t);
      } else {
        out.copy_(at::mm(rows_h, w_t));  // logits in the inputs' dtype, softmax in fp32
      }
    };
    logits_of(hc, z);
    loss_sum.add_(softmax_in_place_and_loss(z, tc, [&](const at::Tensor& rows_idx) {
      at::Tensor zr = at::empty({rows_idx.numel(), V}, f32);
      logits_of(hc.index_select(0, rows_idx), zr);
      return zr;
    }));
    if (grads == Grads::kNone) continue;
    // d(sum of the chunk's losses)/d logits = softmax - one_hot(target), in place.
    at::Tensor dz = z;
    dz.scatter_add_(1, tc, at::full({c, 1}, -1.0f, f32));
    at::Tensor gh = out.grad_hidden.narrow(0, r0, c);
    if (fp32) {
      at::addmm_out(gh, gh, dz, w, 0.0, inv_n);  // beta 0: gh's old contents are ignored
    } else {
      gh.copy_(at::mm(dz.to(w.scalar_type()), w).mul_(inv_n));
    }
    if (grads == Grads::kBoth) grad_w32.addmm_(dz.t(), fp32 ? hc : hc.to(at::kFloat), 1.0, inv_n);
  }
  out.loss = loss_sum.mul_(inv_n).to(at::kFloat);
  if (grads == Grads::kBoth) out.grad_weight = fp32 ? grad_w32 : grad_w32.to(w.scalar_type());
  if (keep_logit_grads) out.grad_logits = logits_buf;
  return out;
}

// d loss / d weight from the kept logits' gradient: (dz^T h) / N, in the weight's dtype.
at::Tensor weight_grad_of(const at::Tensor& grad_logits, const at::Tensor& h,
                          c10::ScalarType dtype) {
  const double inv_n = 1.0 / static_cast<double>(h.size(0));
  at::Tensor h32 = h.scalar_type() == at::kFloat ? h : h.to(at::kFloat);
  at::Tensor g = at::mm(grad_logits.t(), h32).mul_(inv_n);
  return dtype == at::kFloat ? g : g.to(dtype);
}

struct FusedLmLoss : torch::autograd::Function<FusedLmLoss> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& t, int64_t chunk, c10::ScalarType mm) {
    // Keep whichever of the weight's gradient [V, D] and the logits' [N, V] is smaller. The
    // weight itself is never needed in backward.
    Grads grads = Grads::kHidden;
    if (w.requires_grad())
      grads = h.size(0) <= h.size(1) ? Grads::kHiddenNowWeightLater : Grads::kBoth;
    Pass p = run_chunks(h, w, t, chunk, grads, mm);
    ctx->saved_data["grad_hidden"] = p.grad_hidden;
    if (p.grad_weight.defined()) ctx->saved_data["grad_weight"] = p.grad_weight;
    if (p.grad_logits.defined()) {
      ctx->saved_data["grad_logits"] = p.grad_logits;
      ctx->saved_data["hidden"] = h;  // an activation, not the weight: nothing to gather
    }
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(w.scalar_type());
    return p.loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    // The gradients are released after the first backward (51 MB for GPT-2's embedding):
    // a second backward through the same graph has nothing to return.
    if (ctx->saved_data.find("grad_hidden") == ctx->saved_data.end()) {
      throw dtrain::Error(
          "fused_lm_loss: backward through the same loss twice is not supported (its "
          "gradients are computed in forward and released by the first backward)");
    }
    auto saved = std::move(ctx->saved_data);
    ctx->saved_data.clear();
    at::Tensor gh = saved["grad_hidden"].toTensor();
    at::Tensor gw;
    if (saved.count("grad_weight")) gw = saved["grad_weight"].toTensor();
    if (saved.count("grad_logits")) {
      const auto dtype = static_cast<c10::ScalarType>(saved["weight_dtype"].toInt());
      at::Tensor dz = saved["grad_logits"].toTensor();
      at::Tensor h = saved["hidden"].toTensor();
      saved.clear();  // the logits' gradient goes as soon as the weight's is formed
      gw = weight_grad_of(dz, h, dtype);
    }
    const at::Tensor& g = grad_out[0];
    // loss.backward() seeds 1: the saved gradients are already the answer.
    const bool one = g.device().is_cpu() && g.item<double>() == 1.0;
    if (!one) {
      gh = gh * g.to(gh.scalar_type());
      if (gw.defined()) gw = gw * g.to(gw.scalar_type());
    }
    return {gh, gw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fused_lm_loss(const at::Tensor& hidden, const at::Tensor& weight,
                         const at::Tensor& targets, int64_t chunk_rows,
                         std::optional<c10::ScalarType> matmul_dtype) {
  const int64_t D = hidden.size(-1);
  if (weight.dim() != 2 || weight.size(1) != D || weight.scalar_type() != hidden.scalar_type() ||
      !at::isFloatingType(hidden.scalar_type())) {
    throw dtrain::InvalidArgument(fmt::format(
        "fused_lm_loss: hidden [..., D] and weight [V, D] must share D and a floating dtype, "
        "got hidden {} {} and weight {} {}",
        c10::str(hidden.sizes()), c10::toString(hidden.scalar_type()), c10::str(weight.sizes()),
        c10::toString(weight.scalar_type())));
  }
  const int64_t N = hidden.numel() / std::max<int64_t>(D, 1);
  if (targets.scalar_type() != at::kLong || targets.numel() != N || N == 0) {
    throw dtrain::InvalidArgument(fmt::format(
        "fused_lm_loss: targets must be {} int64 values (one per row of hidden), got {} {}", N,
        c10::str(targets.sizes()), c10::toString(targets.scalar_type())));
  }
  if (chunk_rows < 0) throw dtrain::InvalidArgument("fused_lm_loss: chunk_rows must be >= 0");
  const int64_t V = weight.size(0);
  int64_t chunk = chunk_rows;
  if (chunk == 0) {  // equal chunks of at most kChunkBytes of fp32 logits
    const int64_t max_rows = std::max<int64_t>(1, kChunkBytes / (4 * std::max<int64_t>(V, 1)));
    const int64_t chunks = (N + max_rows - 1) / max_rows;
    chunk = (N + chunks - 1) / chunks;
  }
  // On the CPU the matmuls keep the inputs' dtype under autocast: whether bf16 pays there
  // depends on the CPU (docs/benchmarks-history.md, "bf16 vs fp32 by CPU class").
  const std::optional<c10::ScalarType> autocast =
      hidden.is_cpu() ? std::nullopt : dtrain::autocast_dtype(hidden.device().type());
  const c10::ScalarType mm = matmul_dtype.value_or(autocast.value_or(hidden.scalar_type()));
  if (!at::isFloatingType(mm)) {
    throw dtrain::InvalidArgument(
        fmt::format("fused_lm_loss: matmul_dtype must be floating, got {}", c10::toString(mm)));
  }
  at::Tensor h = hidden.reshape({N, D}).contiguous();
  at::Tensor t = targets.reshape({N}).contiguous();
  const bool grads =
      c10::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  if (!grads) {
    c10::NoGradGuard no_grad;
    return run_chunks(h, weight, t, chunk, Grads::kNone, mm).loss;
  }
  return FusedLmLoss::apply(h, weight, t, chunk, mm);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(at::kFloat), targets.reshape({-1}));
}

}  // namespace gpt2

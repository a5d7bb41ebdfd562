// Softmax attention, softmax(q k^T / sqrt(head_dim) + mask) v, through ATen's fused kernel
// (at::scaled_dot_product_attention, LibTorch 2.0 and later: flash/memory-efficient kernels
// that never materialize the [T, T] scores in fp32 autograd graphs) where the LibTorch has
// it, and through the explicit matmul-softmax-matmul otherwise (1.13). Both compute the same
// function; tests compare them (examples/gpt2/tests/model_test.cpp). Public through
// dtrain/attention.h (src/nn/attention.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

#if TORCH_VERSION_MAJOR >= 2
#define DTRAIN_HAS_FUSED_ATTENTION 1
#else
#define DTRAIN_HAS_FUSED_ATTENTION 0
#endif

namespace dtrain::compat {

// Whether fused_attention() runs ATen's fused kernel (false: it runs explicit_attention()).
constexpr bool kHasFusedAttention = DTRAIN_HAS_FUSED_ATTENTION;

// q: [..., Tq, d], k: [..., Tk, d], v: [..., Tk, dv]. `attend` (optional, bool, broadcast to
// [..., Tq, Tk]): true where a query may attend to a key, as at::scaled_dot_product_attention
// takes a bool mask. `causal`: query i attends to keys j <= i only (combined with `attend`).
// `dropout_p`: dropout on the attention weights (0 in evaluation). The scores and the softmax
// are computed in fp32 for reduced-precision inputs; the result has v's dtype.
inline at::Tensor explicit_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const c10::optional<at::Tensor>& attend = c10::nullopt,
                                     bool causal = false, double dropout_p = 0.0) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * scale;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (causal) {
    const int64_t tq = q.size(-2), tk = k.size(-2);
    at::Tensor future = at::ones({tq, tk}, q.options().dtype(at::kBool)).triu(1);
    att = att.masked_fill(future, minus_inf);
  }
  if (attend.has_value() && attend->defined())
    att = att.masked_fill(attend->logical_not(), minus_inf);
  att = at::softmax(att, -1, at::kFloat).to(v.scalar_type());
  if (dropout_p > 0.0) att = at::dropout(att, dropout_p, /*train=*/true);
  return at::matmul(att, v);
}

// The same function as explicit_attention(), through the fused kernel where there is one.
inline at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const c10::optional<at::Tensor>& attend = c10::nullopt,
                                  bool causal = false, double dropout_p = 0.0) {
#if DTRAIN_HAS_FUSED_ATTENTION
  c10::optional<at::Tensor> mask;
  if (attend.has_value() && attend->defined()) mask = *attend;
  if (causal && mask.has_value()) {
    // The kernel refuses a mask together with is_causal: fold causality into the mask.
    const int64_t tq = q.size(-2), tk = k.size(-2);
    mask = mask->logical_and(at::ones({tq, tk}, q.options().dtype(at::kBool)).tril());
    causal = false;
  }
  return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, causal);
#else
  return explicit_attention(q, k, v, attend, causal, dropout_p);
#endif
}

}  // namespace dtrain::compat

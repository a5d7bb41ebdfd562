// Scaled dot-product attention, softmax(q k^T / sqrt(head_dim) + mask) v, for models built on
// dtrain (the GPT-2 and BERT examples use it), the same function on every LibTorch dtrain
// supports:
//   dtrain::attention           through ATen's fused kernel (at::scaled_dot_product_attention,
//                               LibTorch 2.0 and later: flash / memory-efficient kernels that
//                               never keep the [Tq, Tk] scores for backward) where the
//                               LibTorch has it, else through explicit_attention;
//   dtrain::explicit_attention  matmul, mask, fp32 softmax, matmul, on every LibTorch.
// Both are differentiable in q, k and v and give the same values and gradients up to
// floating-point rounding (examples/gpt2/tests/model_test.cpp compares them with a
// reference).
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain {

struct AttentionOptions {
  // Bool, broadcastable to [..., Tq, Tk]: true where a query may attend to a key (the
  // convention of at::scaled_dot_product_attention's bool mask). Undefined: every key.
  at::Tensor attend;
  // Query i attends to keys j <= i only (combined with `attend` when both are given).
  bool causal = false;
  // Dropout probability on the attention weights; 0 in evaluation.
  double dropout_p = 0.0;
};

// q: [..., Tq, d], k: [..., Tk, d], v: [..., Tk, dv] -> [..., Tq, dv] in v's dtype. The
// scores and the softmax are computed in fp32 for reduced-precision inputs.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options = {});

// The same function as attention(), always through the explicit matmul-softmax-matmul (its
// memory: the [..., Tq, Tk] scores are kept for backward).
at::Tensor explicit_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const AttentionOptions& options = {});

// Whether attention() runs ATen's fused kernel with this LibTorch (false: it runs
// explicit_attention). Memory estimates use it: the fused kernel keeps no scores.
bool has_fused_attention();

}  // namespace dtrain

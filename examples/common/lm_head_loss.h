// The LM head's cross-entropy without materializing the logits.
//
// A GPT-2 step spends a large part of its time after the last LayerNorm: logits
// [B*T, vocab] = hidden @ wte^T, log-softmax over 50257 columns, the NLL, and backward
// through all of them (a zero-filled gradient the size of the logits, the log-softmax
// backward with a second exp of every logit, two matmuls). fused_lm_loss computes the same
// loss and gradients in chunks of rows, reusing one chunk-sized buffer: per chunk one
// matmul for the logits, the softmax over them in place (a single exp per logit), the loss
// as -log p[target], the gradient of the chunk's logits in place (p minus the one-hot
// target), and the gradient matmuls. hidden's gradient is computed during forward. So is the
// weight's, unless there are no more rows than D: then the logits' gradient [rows, vocab],
// no larger than the weight's [vocab, D], is kept instead and the weight's gradient formed
// from it in backward, which keeps a [vocab, D] tensor from coexisting with the gathered
// weight at the end of an FSDP forward. Backward never reads the weight itself.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

namespace gpt2 {

// Mean cross-entropy of `logits` [B, T, V] against `targets` [B, T], computed in fp32
// whatever the logits' dtype.
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets);

// Mean over all rows of -log softmax(hidden @ weight^T)[row, target], the same value as
// lm_loss(at::linear(hidden, weight), targets), returned as an fp32 scalar.
//   hidden   [..., D], float/bf16/half (the last LayerNorm's output)
//   weight   [V, D], same dtype (the tied token embedding)
//   targets  int64 [...] with hidden's leading shape, values in [0, V)
//   chunk_rows  rows per chunk; 0: equal chunks whose fp32 logits take at most 128 MiB
//               (GPT-2 tiny at batch 8 x 128: two chunks of 512 rows).
// The logits are formed in the inputs' dtype and the softmax is computed in fp32, as
// lm_loss does on a cast. A row whose target probability underflows fp32 gets its loss
// exactly, from the logits (logsumexp minus the target's logit), never log(0). Differentiable in
// hidden and weight; when grad mode is off or neither requires grad, only the loss is computed.
//   matmul_dtype  the dtype of the three matmuls (logits, hidden's and weight's gradients).
//               Default: under autocast on a GPU, autocast's dtype (as at::linear would; an
//               fp32 matmul there runs without tensor cores), else the inputs' dtype. The
//               softmax, the loss and the weight gradient's accumulation stay in fp32.
// Throws dtrain::InvalidArgument on mismatched shapes or dtypes.
at::Tensor fused_lm_loss(const at::Tensor& hidden, const at::Tensor& weight,
                         const at::Tensor& targets, int64_t chunk_rows = 0,
                         std::optional<c10::ScalarType> matmul_dtype = std::nullopt);

}  // namespace gpt2

// The token plus learned position embedding both examples' models start with (GPT-2's
// wte/wpe, BERT's tok_embed/pos_embed), with a sparse token-table gradient.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/embedding.h>

#include <cstdint>

namespace gpt2 {

// Token plus learned position embeddings [B, T, dim] of int64 ids [B, T], for GPT-2 and
// BERT alike. Throws dtrain::InvalidArgument naming `model` when T exceeds `context`.
// `tokens` must be tied to the model's output head (as in both models): its table's
// gradient is computed sparse (B*T rows, not a zero-filled [vocab, dim] table) and
// autograd adds it in place to the head's dense gradient for the same weight, so .grad
// stays dense. Without a head using the weight .grad would be sparse.
// The lookup's backward keeps only the ids and the row count, never the table, so under
// FSDP the table need not be gathered for it (dtrain::ParamsInBackward::kNotRead).
// With sparse_grad = false the token table's gradient is dense, as torch.nn.Embedding's by
// default: for a device without sparse tensors (the tests' fake accelerator).
at::Tensor embed_tokens(torch::nn::Embedding tokens, torch::nn::Embedding positions,
                        const at::Tensor& idx, int64_t context, const char* model,
                        bool sparse_grad = true);

}  // namespace gpt2

// Small models for strategy tests: an MLP and a causal transformer with tied embeddings
// (the GPT-2 pattern: one parameter used twice in forward).
#pragma once

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>

#include "dtrain/fsdp.h"

namespace dtrain::testing {

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out, bool with_extra = false)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {
    if (with_extra) extra = register_module("extra", torch::nn::Linear(hidden, out));
  }
  // use_extra: a branch whose parameters get no gradient when it is skipped.
  at::Tensor forward(const at::Tensor& x, bool use_extra = false) {
    at::Tensor h = at::tanh(fc1->forward(x));
    h = at::tanh(fc2->forward(h));
    at::Tensor y = fc3->forward(h);
    if (use_extra && extra) y = y + extra->forward(h);
    return y;
  }
  torch::nn::Linear fc1, fc2, fc3;
  torch::nn::Linear extra{nullptr};
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t heads)
      : heads(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        qkv(register_module("qkv", torch::nn::Linear(dim, 3 * dim))),
        proj(register_module("proj", torch::nn::Linear(dim, dim))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        up(register_module("up", torch::nn::Linear(dim, 4 * dim))),
        down(register_module("down", torch::nn::Linear(4 * dim, dim))) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    auto split = [&](const at::Tensor& t) {
      return t.view({B, T, heads, C / heads}).transpose(1, 2);
    };
    at::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(C / heads));
    at::Tensor mask = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
    att = at::softmax(att.masked_fill(mask, -1e9), -1);
    at::Tensor y = at::matmul(att, v).transpose(1, 2).reshape({B, T, C});
    at::Tensor h = x + proj->forward(y);
    at::Tensor n = ln2->forward(h);
    // `up` may be a unit nested in the block's unit (FSDP tests); a no-op call otherwise.
    at::Tensor u = dtrain::unit_call(*up, [&] { return up->forward(n); });
    return h + down->forward(at::gelu(u));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct TinyTransformerImpl : torch::nn::Module {
  TinyTransformerImpl(int64_t vocab, int64_t ctx, int64_t dim, int64_t heads, int64_t layers)
      : wte(register_module("wte", torch::nn::Embedding(vocab, dim))),
        wpe(register_module("wpe", torch::nn::Embedding(ctx, dim))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))) {
    for (int64_t i = 0; i < layers; ++i) {
      blocks.push_back(register_module("h" + std::to_string(i), Block(dim, heads)));
    }
  }
  // Returns logits [B, T, vocab]; the head reuses wte's weight (tied).
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor pos = at::arange(idx.size(1), idx.options());
    at::Tensor x = wte->forward(idx) + wpe->forward(pos);
    for (auto& b : blocks) x = dtrain::unit_call(*b, [&] { return b->forward(x); });
    return torch::nn::functional::linear(ln_f->forward(x), wte->weight);
  }
  torch::nn::Embedding wte, wpe;
  torch::nn::LayerNorm ln_f;
  std::vector<Block> blocks;
};
TORCH_MODULE(TinyTransformer);

}  // namespace dtrain::testing

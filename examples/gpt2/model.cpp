#include "model.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/init.h>

#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/attention.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "lm_head_loss.h"

namespace gpt2 {
namespace {

// at::linear, not Linear::forward: LibTorch's C++ Linear folds the bias into one addmm only
// for 2-D input and otherwise runs a matmul plus a separate `+= bias` (and its backward
// node); at::linear, what Python's F.linear calls, flattens [B, T, C] input into one addmm.
at::Tensor linear(const at::Tensor& x, const torch::nn::Linear& l) {
  return at::linear(x, l->weight, l->bias);
}

torch::nn::LayerNorm layer_norm(int64_t dim) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-5));
}

}  // namespace

void GptConfig::validate() const {
  if (vocab_size <= 0 || context <= 0 || layers <= 0 || heads <= 0 || dim <= 0) {
    throw dtrain::InvalidArgument("GPT config: every dimension must be positive, got " +
                                  to_string());
  }
  if (dim % heads != 0) {
    throw dtrain::InvalidArgument(
        fmt::format("GPT config: dim {} is not a multiple of heads {}", dim, heads));
  }
}

std::string GptConfig::to_string() const {
  return fmt::format("layers={} heads={} dim={} context={} vocab={}", layers, heads, dim, context,
                     vocab_size);
}

GptConfig preset(const std::string& name) {
  GptConfig c;
  if (name == "tiny") {
    c.layers = 4, c.heads = 4, c.dim = 256, c.context = 128;
  } else if (name == "paper-27m") {
    c.layers = 6, c.heads = 6, c.dim = 360, c.context = 256;
  } else if (name == "gpt2") {
    c.layers = 12, c.heads = 12, c.dim = 768, c.context = 1024;
  } else if (name == "gpt2-medium") {  // Hugging Face's shapes (n_layer, n_head, n_embd)
    c.layers = 24, c.heads = 16, c.dim = 1024, c.context = 1024;
  } else if (name == "gpt2-large") {
    c.layers = 36, c.heads = 20, c.dim = 1280, c.context = 1024;
  } else if (name == "gpt2-xl") {
    c.layers = 48, c.heads = 25, c.dim = 1600, c.context = 1024;
  } else {
    throw dtrain::InvalidArgument(fmt::format("unknown model preset '{}' (one of: {})", name,
                                              fmt::join(preset_names(), ", ")));
  }
  return c;
}

std::vector<std::string> preset_names() {
  return {"tiny", "paper-27m", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"};
}

int64_t count_parameters(const GptConfig& c) {
  const int64_t d = c.dim;
  const int64_t block = 2 * 2 * d            // ln_1, ln_2
                        + d * 3 * d + 3 * d  // c_attn
                        + d * d + d          // attn.c_proj
                        + d * 4 * d + 4 * d  // c_fc
                        + 4 * d * d + d;     // mlp.c_proj
  return c.vocab_size * d + c.context * d + c.layers * block + 2 * d;
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t dim, int64_t heads, bool fused)
    : heads(heads),
      fused(fused),
      c_attn(register_module("c_attn", torch::nn::Linear(dim, 3 * dim))),
      c_proj(register_module("c_proj", torch::nn::Linear(dim, dim))) {}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
  auto qkv = linear(x, c_attn).split(C, -1);
  auto to_heads = [&](const at::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
  at::Tensor q = to_heads(qkv[0]), k = to_heads(qkv[1]), v = to_heads(qkv[2]);
  // Either way the softmax runs in fp32 even when the model computes in bf16 (FSDP mixed
  // precision): the fused kernels accumulate in fp32 too.
  dtrain::AttentionOptions causal;
  causal.causal = true;
  at::Tensor y =
      fused ? dtrain::attention(q, k, v, causal) : dtrain::explicit_attention(q, k, v, causal);
  y = y.transpose(1, 2).reshape({B, T, C});
  return linear(y, c_proj);
}

MlpImpl::MlpImpl(int64_t dim)
    : c_fc(register_module("c_fc", torch::nn::Linear(dim, 4 * dim))),
      c_proj(register_module("c_proj", torch::nn::Linear(4 * dim, dim))) {}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return linear(at::gelu(linear(x, c_fc), "tanh"), c_proj);
}

BlockImpl::BlockImpl(int64_t dim, int64_t heads, bool fused_attention)
    : ln_1(register_module("ln_1", layer_norm(dim))),
      attn(register_module("attn", CausalSelfAttention(dim, heads, fused_attention))),
      ln_2(register_module("ln_2", layer_norm(dim))),
      mlp(register_module("mlp", Mlp(dim))) {}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attn->forward(ln_1->forward(x));
  return h + mlp->forward(ln_2->forward(h));
}

GptImpl::GptImpl(const GptConfig& config)
    : wte(nullptr), wpe(nullptr), h(nullptr), ln_f(nullptr), config_(config) {
  config_.validate();
  // Deferred: each part gives its memory back as soon as it is built.
  auto built = [&](torch::nn::Module& m) {
    if (config_.deferred) dtrain::defer_parameters(m, config_.deferred_device);
  };
  wte = register_module("wte", torch::nn::Embedding(config_.vocab_size, config_.dim));
  built(*wte);
  wpe = register_module("wpe", torch::nn::Embedding(config_.context, config_.dim));
  built(*wpe);
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.layers; ++i) {
    blocks.push_back(Block(config_.dim, config_.heads, config_.fused_attention));
    built(*blocks.back());
    h->push_back(blocks.back());
  }
  ln_f = register_module("ln_f", layer_norm(config_.dim));
  built(*ln_f);
  if (!config_.deferred) reset_parameters();
}

dtrain::DeferredInit param_init(const GptConfig& config, uint64_t seed) {
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers));
  auto ends_with = [](const std::string& s, const char* suffix) {
    const std::string t(suffix);
    return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  return dtrain::DeferredInit{
      seed, [=](const std::string& name, at::Tensor& p, at::Generator& gen) {
        if (ends_with(name, ".bias")) {  // Linear and LayerNorm biases
          p.zero_();
        } else if (ends_with(name, "ln_1.weight") || ends_with(name, "ln_2.weight") ||
                   ends_with(name, "ln_f.weight")) {
          p.fill_(1.0);
        } else if (ends_with(name, "c_proj.weight")) {  // the residual projections
          p.normal_(0.0, residual_std, gen);
        } else {  // wte, wpe, c_attn, c_fc
          p.normal_(0.0, 0.02, gen);
        }
      }};
}

void GptImpl::reset_parameters() {
  namespace init = torch::nn::init;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers));
  init::normal_(wte->weight, 0.0, 0.02);
  init::normal_(wpe->weight, 0.0, 0.02);
  auto linear = [](torch::nn::Linear& l, double std) {
    init::normal_(l->weight, 0.0, std);
    init::zeros_(l->bias);
  };
  auto norm = [](torch::nn::LayerNorm& n) {
    init::ones_(n->weight);
    init::zeros_(n->bias);
  };
  for (auto& b : blocks) {
    norm(b->ln_1);
    norm(b->ln_2);
    linear(b->attn->c_attn, 0.02);
    linear(b->attn->c_proj, residual_std);
    linear(b->mlp->c_fc, 0.02);
    linear(b->mlp->c_proj, residual_std);
  }
  norm(ln_f);
}

at::Tensor GptImpl::forward(const at::Tensor& idx) { return head(hidden(idx)); }

at::Tensor GptImpl::head(const at::Tensor& hidden) {
  // The LM head is the token embedding, transposed: no second parameter. Its backward reads
  // the table (the gradient for `hidden` is grad @ wte). Without grad mode (generation)
  // there is no backward, as with the fused loss that training calls wte with last.
  const auto reads = c10::GradMode::is_enabled() ? dtrain::ParamsInBackward::kRead
                                                 : dtrain::ParamsInBackward::kNotRead;
  return dtrain::unit_call(
      *wte, [&] { return at::linear(hidden, wte->weight); }, reads);
}

at::Tensor GptImpl::loss(const at::Tensor& idx, const at::Tensor& targets, bool fused) {
  if (!fused) return lm_loss(forward(idx), targets);
  at::Tensor h = hidden(idx);
  // fused_lm_loss forms its gradients in forward: its backward reads no weight.
  return dtrain::unit_call(
      *wte, [&] { return fused_lm_loss(h, wte->weight, targets); },
      dtrain::ParamsInBackward::kNotRead);
}

at::Tensor GptImpl::hidden(const at::Tensor& idx) {
  // The token lookup's backward needs only idx (embed_tokens): with wte a unit of its own
  // (GptTask under FSDP), the table is not gathered for it.
  at::Tensor x = dtrain::unit_call(
      *wte,
      [&] {
        return embed_tokens(wte, wpe, idx, config_.context, "GPT", config_.sparse_token_grad);
      },
      dtrain::ParamsInBackward::kNotRead);
  for (auto& block : blocks) {
    // A no-op wrapper except under FSDP, where it gathers and frees the block's weights (and
    // gathers them again before a checkpointed block is recomputed).
    x = dtrain::unit_call(*block, [&] {
      if (!config_.activation_checkpointing) return block->forward(x);
      return dtrain::checkpoint(
          [b = block](const at::Tensor& in) mutable { return b->forward(in); }, x);
    });
  }
  return ln_f->forward(x);
}

}  // namespace gpt2

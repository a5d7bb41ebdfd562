#include "bert_model.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/transformerlayer.h>

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/attention.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "lm_head_loss.h"
#include "token_embedding.h"

namespace bert {

void BertConfig::validate() const {
  if (vocab_size <= 0 || context <= 0 || layers <= 0 || heads <= 0 || dim <= 0 || ffn_dim <= 0) {
    throw dtrain::InvalidArgument("BERT config: every dimension must be positive, got " +
                                  to_string());
  }
  if (dim % heads != 0) {
    throw dtrain::InvalidArgument(
        fmt::format("BERT config: dim {} is not a multiple of heads {}", dim, heads));
  }
  if (!(dropout >= 0.0 && dropout < 1.0)) {
    throw dtrain::InvalidArgument(fmt::format("BERT config: dropout {} is not in [0, 1)", dropout));
  }
}

std::string BertConfig::to_string() const {
  return fmt::format("layers={} heads={} dim={} ffn={} context={} vocab={} dropout={}", layers,
                     heads, dim, ffn_dim, context, vocab_size, dropout);
}

BertConfig preset(const std::string& name) {
  BertConfig c;
  if (name == "bert-tiny") {
    c.layers = 4, c.heads = 4, c.dim = 256, c.ffn_dim = 1024, c.context = 128;
  } else if (name == "bert") {
    c.layers = 10, c.heads = 7, c.dim = 448, c.ffn_dim = 1792, c.context = 128;
  } else {
    throw dtrain::InvalidArgument(fmt::format("unknown BERT preset '{}' (one of: {})", name,
                                              fmt::join(preset_names(), ", ")));
  }
  return c;
}

std::vector<std::string> preset_names() { return {"bert-tiny", "bert"}; }

bool is_preset(const std::string& name) {
  const auto names = preset_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

int64_t count_parameters(const BertConfig& c) {
  const int64_t d = c.dim, f = c.ffn_dim;
  const int64_t layer = 3 * d * d + 3 * d  // self_attn.in_proj (q, k, v)
                        + d * d + d        // self_attn.out_proj
                        + d * f + f        // linear1
                        + f * d + d        // linear2
                        + 2 * 2 * d;       // norm1, norm2
  return c.vocab_size * d + c.context * d + c.layers * layer + 2 * d;
}

BertImpl::BertImpl(const BertConfig& config)
    : tok_embed(nullptr), pos_embed(nullptr), layers(nullptr), ln_f(nullptr), config_(config) {
  config_.validate();
  tok_embed = register_module("tok_embed", torch::nn::Embedding(config_.vocab_size, config_.dim));
  pos_embed = register_module("pos_embed", torch::nn::Embedding(config_.context, config_.dim));
  layers = register_module("layers", torch::nn::Sequential());
  for (int64_t i = 0; i < config_.layers; ++i) {
    layers->push_back(torch::nn::TransformerEncoderLayer(
        torch::nn::TransformerEncoderLayerOptions(config_.dim, config_.heads)
            .dim_feedforward(config_.ffn_dim)
            .dropout(config_.dropout)
            .activation(torch::kGELU)));
  }
  ln_f = register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config_.dim}).eps(1e-5)));
  reset_parameters();
}

void BertImpl::reset_parameters() {
  namespace init = torch::nn::init;
  c10::NoGradGuard no_grad;
  // By shape and module type rather than by name, so it holds for whatever the stock layers
  // register: matrices are embedding or Linear weights, other vectors are biases.
  for (at::Tensor& p : parameters(/*recurse=*/true)) {
    if (p.dim() >= 2) {
      init::normal_(p, 0.0, 0.02);
    } else {
      init::zeros_(p);
    }
  }
  for (const auto& m : modules(/*include_self=*/false)) {
    if (auto* norm = m->as<torch::nn::LayerNorm>()) init::ones_(norm->weight);
  }
}

namespace {

// What torch::nn::TransformerEncoderLayer's forward computes (post-LayerNorm: x + attention,
// norm1, + feed-forward, norm2; GELU; LibTorch's dropout placement), from the layer's own
// parameters, with the attention through dtrain::attention. x: [T, B, dim].
at::Tensor encoder_layer_forward(torch::nn::TransformerEncoderLayerImpl& layer,
                                 const at::Tensor& x) {
  auto& mha = *layer.self_attn;
  const int64_t T = x.size(0), B = x.size(1), C = x.size(2);
  const int64_t heads = mha.options.num_heads(), hd = C / heads;
  auto qkv = at::linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1);
  // [T, B, C] -> [B, heads, T, hd]
  auto to_heads = [&](const at::Tensor& t) {
    return t.view({T, B, heads, hd}).permute({1, 2, 0, 3});
  };
  const double p = layer.is_training() ? mha.options.dropout() : 0.0;
  dtrain::AttentionOptions options;
  options.dropout_p = p;
  at::Tensor y = dtrain::attention(to_heads(qkv[0]), to_heads(qkv[1]), to_heads(qkv[2]), options);
  y = mha.out_proj->forward(y.permute({2, 0, 1, 3}).reshape({T, B, C}));
  at::Tensor h = layer.norm1->forward(x + layer.dropout1->forward(y));
  at::Tensor f =
      layer.linear2->forward(layer.dropout->forward(at::gelu(layer.linear1->forward(h))));
  return layer.norm2->forward(h + layer.dropout2->forward(f));
}

}  // namespace

at::Tensor BertImpl::hidden(const at::Tensor& idx) {
  at::Tensor x = gpt2::embed_tokens(tok_embed, pos_embed, idx, config_.context, "BERT");
  // LibTorch's encoder layers take [T, B, dim] (sequence first).
  x = x.transpose(0, 1);
  const bool own = config_.fused_attention;
  if (!own && !config_.activation_checkpointing) {
    x = layers->forward(x);
  } else {
    // The registered layers, not the Sequential's entries (FSDP may have replaced those):
    // unit_call around the layer (and outside a checkpoint), so that FSDP gathers a layer
    // around its forward and its recompute in backward. Outside FSDP unit_call is a plain call.
    for (const auto& layer : layers->children()) {
      auto* stock = layer->as<torch::nn::TransformerEncoderLayer>();
      auto run = [stock, own](const at::Tensor& in) {
        return own ? encoder_layer_forward(*stock, in) : stock->forward(in);
      };
      x = dtrain::unit_call(*layer, [&] {
        return config_.activation_checkpointing ? dtrain::checkpoint(run, x) : run(x);
      });
    }
  }
  return ln_f->forward(x.transpose(0, 1));
}

at::Tensor BertImpl::forward(const at::Tensor& idx) {
  return at::linear(hidden(idx), tok_embed->weight);
}

at::Tensor BertImpl::loss(const at::Tensor& idx, const at::Tensor& targets, bool fused) {
  at::Tensor h = hidden(idx);
  at::Tensor flat_targets = targets.reshape({-1});
  // The head and its softmax only for the masked rows (15% of them).
  at::Tensor rows = flat_targets.ge(0).nonzero().squeeze(1);
  if (rows.numel() == 0) {
    throw dtrain::InvalidArgument("BERT loss: no position is masked (every target is < 0)");
  }
  at::Tensor hr = h.reshape({-1, config_.dim}).index_select(0, rows);
  at::Tensor tr = flat_targets.index_select(0, rows);
  return fused ? gpt2::fused_lm_loss(hr, tok_embed->weight, tr)
               : gpt2::lm_loss(at::linear(hr, tok_embed->weight), tr);
}

}  // namespace bert

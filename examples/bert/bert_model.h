// A BERT-style encoder for masked-language-model training (the second model of the
// custom-FSDP report, whose BERT has 46.7M parameters), built from LibTorch's stock
// torch::nn::TransformerEncoderLayer: token and learned position embeddings, `layers` stock
// encoder layers (post-LayerNorm, bidirectional self-attention, GELU feed-forward) held in
// a torch::nn::Sequential, a final LayerNorm, and an MLM head tied to the token embedding
// (logits = hidden @ tok_embed^T; no parameter of its own).
//
// FullyShardedDataParallel makes each layer a unit with
// wrap_modules_named("TransformerEncoderLayer"). With BertConfig::fused_attention off the
// layers are stock modules reached only through Sequential::forward, and FSDP needs no model
// edit (see dtrain/fsdp.h). With it on (the default) each layer's forward is computed from the
// stock layer's own parameters with the attention through ATen's fused kernel
// (at::scaled_dot_product_attention; LibTorch's C++ MultiheadAttention never uses it), and the
// layers are called one by one inside dtrain::unit_call, as GPT-2's blocks are; so is every
// recompute of activation checkpointing (BertConfig::activation_checkpointing).
//
// Parameter names: "tok_embed.weight", "pos_embed.weight", "layers.3.self_attn.in_proj_weight",
// "layers.3.linear1.weight", "layers.3.norm2.bias", ..., "ln_f.weight".
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace bert {

struct BertConfig {
  // Embedding rows, including the [MASK] id: the tokenizer's vocabulary plus one (GPT-2's
  // 50257 ids + [MASK]); see mlm_data.h.
  int64_t vocab_size = 50258;
  int64_t context = 128;  // longest sequence (rows of the position embedding)
  int64_t layers = 10;
  int64_t heads = 7;
  int64_t dim = 448;          // d_model; a multiple of heads
  int64_t ffn_dim = 4 * 448;  // the feed-forward layer's width (dim_feedforward)
  // Dropout inside the stock layers. 0 (the presets): ranks would otherwise draw different
  // dropout masks and DDP/FSDP could not be compared with single-device training step by step.
  double dropout = 0.0;
  // Recompute every layer's forward during backward instead of keeping its activations
  // (dtrain::checkpoint): only the layers' inputs stay alive, for one more forward's time.
  bool activation_checkpointing = false;
  // Attention through ATen's fused kernel where the LibTorch has one (2.x; the explicit one
  // on 1.13), in dtrain's forward of each stock layer; false: the stock layers' own forward.
  // The same function either way (tests/bert_model_test.cpp compares them).
  bool fused_attention = true;

  // Throws dtrain::InvalidArgument when a dimension is not positive, dim % heads != 0 or
  // dropout is outside [0, 1).
  void validate() const;
  std::string to_string() const;
};

// Presets, with the GPT-2 vocabulary plus [MASK] (50258 rows):
//   "bert-tiny"  4 layers, 4 heads, dim 256, ffn 1024, context 128: 16,058,368 parameters
//   "bert"      10 layers, 7 heads, dim 448, ffn 1792, context 128: 46,716,544 parameters
//               (the custom-FSDP report's BERT has 46.7M; head size 64 as in BERT)
// Throws dtrain::InvalidArgument for another name.
BertConfig preset(const std::string& name);
std::vector<std::string> preset_names();
bool is_preset(const std::string& name);

// Parameters of a model with `config`, without building it (the tied head counts once).
int64_t count_parameters(const BertConfig& config);

struct BertImpl : torch::nn::Module {
  // Builds the model and applies BERT's initialization (see reset_parameters), drawing from
  // LibTorch's default generator: seed it (at::manual_seed) for reproducible weights.
  explicit BertImpl(const BertConfig& config);

  // The final LayerNorm's output [B, T, dim] for int64 token ids [B, T], T <= context. Every
  // position attends to every position (no mask: sequences are never padded here).
  at::Tensor hidden(const at::Tensor& idx);

  // Logits [B, T, vocab_size]: hidden(idx) times the token embedding, transposed.
  at::Tensor forward(const at::Tensor& idx);

  // The MLM loss: mean cross-entropy over the positions whose target is >= 0 (the masked
  // ones; mlm_data.h writes kIgnoreTarget elsewhere), as an fp32 scalar. Only those rows
  // reach the head. With `fused` through gpt2::fused_lm_loss (no [rows, vocab] logits kept),
  // else logits plus cross_entropy; the same value up to fp32 rounding. Throws
  // dtrain::InvalidArgument when no position is masked.
  at::Tensor loss(const at::Tensor& idx, const at::Tensor& targets, bool fused = true);

  // BERT's initialization: every embedding and Linear weight (the layers' in_proj_weight
  // included) ~ N(0, 0.02), biases 0, LayerNorm weight 1 and bias 0.
  void reset_parameters();

  const BertConfig& config() const { return config_; }

  torch::nn::Embedding tok_embed;  // also the MLM head's weight (tied)
  torch::nn::Embedding pos_embed;
  torch::nn::Sequential layers;  // stock TransformerEncoderLayers, registered as layers.0, ...
  torch::nn::LayerNorm ln_f;

 private:
  BertConfig config_;
};
TORCH_MODULE(Bert);

}  // namespace bert

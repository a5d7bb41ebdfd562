// GPT-2 as a torch::nn module: token and learned position embeddings, pre-LayerNorm
// transformer blocks (causal self-attention, GELU MLP), a final LayerNorm and an LM head
// tied to the token embedding. Parameter names follow OpenAI's / Hugging Face's GPT-2
// ("wte", "wpe", "h.0.attn.c_attn", "h.0.mlp.c_fc", ..., "ln_f").
//
// Each block runs through dtrain::unit_call, so FullyShardedDataParallel with
// wrap_modules_named("BlockImpl") makes every block a unit; under every other strategy the
// call is a plain forward. So do the token embedding's two uses (the lookup and the LM head),
// so that wte can be a unit too: with the fused loss neither use's backward reads the table
// (dtrain::ParamsInBackward::kNotRead), and FSDP frees it from the end of forward on.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/deferred_init.h"
// embed_tokens and lm_loss, shared with the BERT example (examples/common).
#include "lm_head_loss.h"
#include "token_embedding.h"

namespace gpt2 {

struct GptConfig {
  int64_t vocab_size = 50257;
  int64_t context = 1024;  // longest sequence (rows of the position embedding)
  int64_t layers = 12;
  int64_t heads = 12;
  int64_t dim = 768;  // embedding width; a multiple of heads
  // Recompute every block's forward during backward instead of keeping its activations
  // (dtrain::checkpoint): only the blocks' inputs stay alive, for one more forward's time.
  bool activation_checkpointing = false;
  // Attention through ATen's fused kernel (at::scaled_dot_product_attention) where the
  // LibTorch has one (2.x); false, or on 1.13: the explicit matmul, causal mask, fp32
  // softmax, matmul. The same function either way (tests/model_test.cpp compares them).
  bool fused_attention = true;
  // The token table's gradient from the lookup: sparse (B*T rows, added to the tied head's
  // dense gradient; embed_tokens) or, false, dense as torch.nn.Embedding's, for a device
  // without sparse tensors (dtrain_bench_launches on the tests' fake accelerator).
  bool sparse_token_grad = true;
  // Build with deferred parameters on `deferred_device` (dtrain::defer_parameters, each
  // block right after it is built, so building holds one block at most) and skip
  // reset_parameters: for FullyShardedDataParallel with FsdpOptions::deferred_init =
  // param_init(...), or dtrain::init_parameters.
  bool deferred = false;
  c10::Device deferred_device = c10::Device(c10::kCPU);

  // Throws dtrain::InvalidArgument when a dimension is not positive or dim % heads != 0.
  void validate() const;
  std::string to_string() const;
};

// Presets:
//   "tiny"      4 layers,  4 heads, dim 256, context  128: 16.1M parameters
//   "paper-27m" 6 layers,  6 heads, dim 360, context  256: 27.5M parameters (the size of the
//               GPT-2 in the custom-FSDP report, 27.32M)
//   "gpt2"     12 layers, 12 heads, dim 768, context 1024: 124.4M parameters (GPT-2 small)
//   "gpt2-medium" 24 layers, 16 heads, dim 1024, context 1024: 354.8M parameters
//   "gpt2-large"  36 layers, 20 heads, dim 1280, context 1024: 774.0M parameters
//   "gpt2-xl"     48 layers, 25 heads, dim 1600, context 1024: 1557.6M parameters
// (the last three: Hugging Face's gpt2-medium, gpt2-large and gpt2-xl shapes), all with the
// GPT-2 vocabulary (50257). Throws dtrain::InvalidArgument for another name.
GptConfig preset(const std::string& name);
std::vector<std::string> preset_names();

// Parameters of a model with `config`, without building it (the tied head counts once).
int64_t count_parameters(const GptConfig& config);

// GPT-2's initialization (GptImpl::reset_parameters) as a per-parameter init for
// dtrain::DeferredInit: each parameter from its own generator (seed, name), so the values
// are the same under every strategy, sharding and world size (dtrain/deferred_init.h).
dtrain::DeferredInit param_init(const GptConfig& config, uint64_t seed);

struct CausalSelfAttentionImpl : torch::nn::Module {
  // fused: GptConfig::fused_attention.
  CausalSelfAttentionImpl(int64_t dim, int64_t heads, bool fused = true);
  // x: [B, T, dim] -> [B, T, dim]; position t attends to positions <= t.
  at::Tensor forward(const at::Tensor& x);

  int64_t heads;
  bool fused;
  torch::nn::Linear c_attn;  // q, k, v projections in one matrix: dim -> 3 * dim
  torch::nn::Linear c_proj;  // output (residual) projection
};
TORCH_MODULE(CausalSelfAttention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t dim);
  at::Tensor forward(const at::Tensor& x);  // c_proj(gelu_tanh(c_fc(x)))

  torch::nn::Linear c_fc;    // dim -> 4 * dim
  torch::nn::Linear c_proj;  // 4 * dim -> dim (residual projection)
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t heads, bool fused_attention = true);
  at::Tensor forward(const at::Tensor& x);  // x + attn(ln_1(x)), then + mlp(ln_2(.))

  torch::nn::LayerNorm ln_1;
  CausalSelfAttention attn;
  torch::nn::LayerNorm ln_2;
  Mlp mlp;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  // Builds the model and applies GPT-2's initialization (see reset_parameters), drawing
  // from LibTorch's default generator: seed it (at::manual_seed) for reproducible weights.
  // With config.deferred the parameters are deferred instead (no memory, no values).
  explicit GptImpl(const GptConfig& config);

  // idx: int64 token ids [B, T] with T <= context. Returns logits [B, T, vocab_size] in the
  // parameters' dtype.
  at::Tensor forward(const at::Tensor& idx);

  // The final LayerNorm's output [B, T, dim]: forward(idx) is head(hidden(idx)).
  at::Tensor hidden(const at::Tensor& idx);
  // The LM head: logits [..., vocab_size] = hidden @ wte^T.
  at::Tensor head(const at::Tensor& hidden);

  // Mean cross-entropy of the next-token prediction: lm_loss(forward(idx), targets), or with
  // `fused` the same loss through fused_lm_loss (lm_head_loss.h), which never materializes
  // the [B, T, vocab] logits.
  at::Tensor loss(const at::Tensor& idx, const at::Tensor& targets, bool fused = true);

  // GPT-2's initialization: Linear and Embedding weights ~ N(0, 0.02), the residual
  // projections (attn.c_proj, mlp.c_proj) ~ N(0, 0.02 / sqrt(2 * layers)), biases 0,
  // LayerNorm weight 1 and bias 0.
  void reset_parameters();

  const GptConfig& config() const { return config_; }

  torch::nn::Embedding wte;  // also the LM head's weight (tied)
  torch::nn::Embedding wpe;
  torch::nn::ModuleList h;  // the blocks, registered as h.0, h.1, ...
  torch::nn::LayerNorm ln_f;
  std::vector<Block> blocks;  // typed handles of h's entries

 private:
  GptConfig config_;
};
TORCH_MODULE(Gpt);

}  // namespace gpt2

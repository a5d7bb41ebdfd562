// Tests of the GPT-2 module: sizes of the presets, the tied head, causality and GPT-2's
// initialization.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include "dtrain/attention.h"
#include "dtrain/errors.h"
#include "dtrain/safetensors.h"
#include "hf_weights.h"
#include "model.h"

namespace gpt2 {
namespace {

GptConfig small() {
  GptConfig c;
  c.vocab_size = 61;
  c.context = 16;
  c.layers = 2;
  c.heads = 2;
  c.dim = 32;
  return c;
}

int64_t numel_of_parameters(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

TEST(GptModel, PresetSizes) {
  EXPECT_EQ(count_parameters(preset("gpt2")), 124439808);  // GPT-2 small, as published
  const int64_t tiny = count_parameters(preset("tiny"));
  EXPECT_NEAR(static_cast<double>(tiny), 16.1e6, 0.1e6);
  EXPECT_NEAR(static_cast<double>(count_parameters(preset("paper-27m"))), 27.3e6, 0.3e6);
  // Hugging Face's gpt2-medium, gpt2-large and gpt2-xl (tied head counted once).
  EXPECT_EQ(count_parameters(preset("gpt2-medium")), 354823168);
  EXPECT_EQ(count_parameters(preset("gpt2-large")), 774030080);
  EXPECT_EQ(count_parameters(preset("gpt2-xl")), 1557611200);
  for (const char* name : {"gpt2-medium", "gpt2-large", "gpt2-xl"}) {
    const GptConfig c = preset(name);
    EXPECT_EQ(c.dim % c.heads, 0) << name;
    EXPECT_EQ(c.dim / c.heads, 64) << name;  // HF's head size
    EXPECT_EQ(c.context, 1024) << name;
  }
  at::manual_seed(0);
  Gpt model(preset("tiny"));
  EXPECT_EQ(numel_of_parameters(*model), tiny);
  EXPECT_THROW(preset("huge"), std::exception);
}

// Deferred: built without keeping any parameter's memory; param_init then gives the values
// GPT-2's initialization prescribes, the same for a deferred and a built model.
TEST(GptModel, DeferredBuildAndPerParameterInit) {
  GptConfig deferred = small();
  deferred.deferred = true;
  Gpt lazy(deferred);
  for (const auto& item : lazy->named_parameters()) {
    EXPECT_TRUE(dtrain::is_deferred(item.value())) << item.key();
  }
  at::manual_seed(3);
  Gpt built(small());
  const dtrain::DeferredInit init = param_init(small(), 1234);
  dtrain::init_parameters(*lazy, init);
  dtrain::init_parameters(*built, init);
  auto want = built->named_parameters();
  for (const auto& item : lazy->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key();
  }
  // GPT-2's values: LayerNorm 1/0, biases 0, residual projections narrower than the others.
  EXPECT_TRUE(at::equal(lazy->ln_f->weight, at::ones_like(lazy->ln_f->weight)));
  EXPECT_EQ(lazy->blocks[1]->mlp->c_fc->bias.abs().max().item<float>(), 0.0f);
  const double proj = lazy->blocks[0]->attn->c_proj->weight.std().item<double>();
  const double attn = lazy->blocks[0]->attn->c_attn->weight.std().item<double>();
  EXPECT_NEAR(attn, 0.02, 0.004);
  EXPECT_NEAR(proj, 0.02 / std::sqrt(4.0), 0.003);
  // Another seed, other values; each parameter its own stream.
  dtrain::init_parameters(*built, param_init(small(), 1235));
  EXPECT_FALSE(at::equal(built->wte->weight, lazy->wte->weight));
  EXPECT_FALSE(at::equal(lazy->blocks[0]->attn->c_attn->weight.flatten().narrow(0, 0, 64),
                         lazy->blocks[1]->attn->c_attn->weight.flatten().narrow(0, 0, 64)));
}

TEST(GptModel, HeadIsTiedToTokenEmbedding) {
  at::manual_seed(0);
  Gpt model(small());
  for (const auto& item : model->named_parameters()) {
    EXPECT_EQ(item.key().find("head"), std::string::npos) << item.key();
  }
  EXPECT_EQ(numel_of_parameters(*model), count_parameters(small()));
  // Zeroing the embedding zeroes the logits: the head reads the same tensor.
  {
    c10::NoGradGuard no_grad;
    model->wte->weight.zero_();
  }
  at::Tensor logits = model->forward(at::zeros({1, 4}, at::kLong));
  EXPECT_EQ(logits.abs().max().item<double>(), 0.0);
}

// The token table's gradient is computed sparse and added to the tied head's dense one:
// .grad must come out dense and equal to the all-dense computation (repeated ids included),
// in fp32 and bf16 (FSDP's param_dtype).
TEST(GptModel, TiedTokenEmbeddingGradientIsDenseAndExact) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(2);
    torch::nn::Embedding tokens(61, 8), positions(16, 8);
    tokens->weight.set_data(tokens->weight.to(dtype));
    positions->weight.set_data(positions->weight.to(dtype));
    at::Tensor idx = at::randint(61, {3, 16}, at::kLong);
    idx[1][3] = idx[0][0].item<int64_t>();  // a repeated id
    at::Tensor r = at::randn({3, 16, 8}).to(dtype), head = at::randn({61, 8}).to(dtype);
    auto loss_of = [&](const at::Tensor& x, const at::Tensor& w) {
      return (x * r).sum() + (w * head).sum();  // `head`: a dense use of the same weight
    };
    loss_of(embed_tokens(tokens, positions, idx, 16, "GPT"), tokens->weight).backward();
    at::Tensor w = tokens->weight.detach().clone().requires_grad_(true);
    at::Tensor x = at::embedding(w, idx) + positions->weight.detach().narrow(0, 0, 16);
    loss_of(x, w).backward();
    const at::Tensor& got = tokens->weight.grad();
    ASSERT_TRUE(got.defined());
    EXPECT_EQ(got.layout(), at::kStrided) << dtype;
    EXPECT_EQ(got.scalar_type(), dtype);
    // bf16: the sums may round in another order (8 bits of mantissa).
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
    EXPECT_TRUE(at::allclose(got.to(at::kFloat), w.grad().to(at::kFloat), tol, tol)) << dtype;
  }
}

TEST(GptModel, OutputShapeAndInitialLoss) {
  at::manual_seed(1);
  Gpt model(small());
  at::Tensor idx = at::randint(61, {3, 16}, at::kLong);
  at::Tensor logits = model->forward(idx);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 16, 61}));
  // Small initial weights: close to the uniform prediction's loss, ln(V), for targets
  // unrelated to the inputs (with the tied head, a token's own id scores higher).
  at::Tensor targets = at::randint(61, {3, 16}, at::kLong);
  EXPECT_NEAR(lm_loss(logits, targets).item<double>(), std::log(61.0), 0.3);
  EXPECT_THROW(model->forward(at::zeros({1, 17}, at::kLong)), std::exception);
}

TEST(GptModel, AttentionIsCausal) {
  at::manual_seed(2);
  Gpt model(small());
  c10::NoGradGuard no_grad;
  at::Tensor a = at::randint(61, {2, 12}, at::kLong);
  at::Tensor b = a.clone();
  b.select(1, 7).fill_(0);
  b.select(1, 11).fill_(1);
  at::Tensor la = model->forward(a), lb = model->forward(b);
  EXPECT_TRUE(at::allclose(la.narrow(1, 0, 7), lb.narrow(1, 0, 7), 1e-5, 1e-6));
  EXPECT_FALSE(at::allclose(la.narrow(1, 7, 1), lb.narrow(1, 7, 1), 1e-5, 1e-6));
}

// Attention written independently of dtrain/attention.h, in double: every query row
// takes the softmax over exactly the keys it may see (key j <= i when causal, and j < len[b]
// for a padded batch), gathered by index, so a wrong mask shows up as a different result.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               bool causal, const std::vector<int64_t>& len) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3);
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < T; ++j) {
          if ((!causal || j <= i) && j < len[b]) keys.push_back(j);
        }
        at::Tensor idx = at::tensor(keys, at::kLong);
        at::Tensor kk = k[b][h].index_select(0, idx), vv = v[b][h].index_select(0, idx);
        at::Tensor s = at::mv(kk, q[b][h][i]) / std::sqrt(static_cast<double>(d));
        at::Tensor p = at::exp(s - s.max());
        rows.push_back(at::mv(vv.t(), p / p.sum()));
      }
    }
  }
  return at::stack(rows).view({B, H, T, v.size(3)});
}

struct AttentionGrads {
  at::Tensor out, dq, dk, dv;
};

// The output and the gradients of sum(out * w) with respect to q, k and v.
template <typename Fn>
AttentionGrads attention_grads(Fn fn, const at::Tensor& q0, const at::Tensor& k0,
                               const at::Tensor& v0, const at::Tensor& w) {
  at::Tensor q = q0.detach().requires_grad_(), k = k0.detach().requires_grad_(),
             v = v0.detach().requires_grad_();
  at::Tensor out = fn(q, k, v);
  (out * w.to(out.scalar_type())).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// Both paths of dtrain/attention.h (ATen's fused kernel on 2.x, the explicit fallback always)
// against the reference, in fp32: the fp32 results may differ from the double reference by
// round-off only, bounded here by rtol 1e-5 and atol 1e-6 for outputs and gradients alike.
TEST(Attention, FusedAndExplicitMatchAReferenceWithCausalAndPaddingMasks) {
  at::manual_seed(5);
  const int64_t B = 2, H = 3, T = 7, d = 8;
  at::Tensor q = at::randn({B, H, T, d}), k = at::randn({B, H, T, d}), v = at::randn({B, H, T, d});
  at::Tensor w = at::randn({B, H, T, d});
  const std::vector<int64_t> full{T, T}, padded{T, 4};
  // Keys past each sequence's length are padding: [B, 1, 1, T], true where a key is real.
  at::Tensor attend = at::arange(T).view({1, 1, 1, T}) < at::tensor(padded).view({B, 1, 1, 1});
  for (const bool causal : {false, true}) {
    for (const bool pad : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "causal " << causal << ", padding " << pad);
      dtrain::AttentionOptions options;
      options.causal = causal;
      if (pad) options.attend = attend;
      const auto want = attention_grads(
          [&](auto& a, auto& b, auto& c) {
            return reference_attention(a, b, c, causal, pad ? padded : full);
          },
          q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), w);
      const auto fused = attention_grads(
          [&](auto& a, auto& b, auto& c) { return dtrain::attention(a, b, c, options); }, q, k, v,
          w);
      const auto expl = attention_grads(
          [&](auto& a, auto& b, auto& c) { return dtrain::explicit_attention(a, b, c, options); },
          q, k, v, w);
      for (const auto* got : {&fused, &expl}) {
        const char* which = got == &fused ? "fused" : "explicit";
        EXPECT_TRUE(at::allclose(got->out.to(at::kDouble), want.out, 1e-5, 1e-6)) << which;
        EXPECT_TRUE(at::allclose(got->dq.to(at::kDouble), want.dq, 1e-5, 1e-6)) << which << " dq";
        EXPECT_TRUE(at::allclose(got->dk.to(at::kDouble), want.dk, 1e-5, 1e-6)) << which << " dk";
        EXPECT_TRUE(at::allclose(got->dv.to(at::kDouble), want.dv, 1e-5, 1e-6)) << which << " dv";
      }
    }
  }
}

// The model with fused attention (at::scaled_dot_product_attention on LibTorch 2.x) and with
// the explicit one: the same loss and gradients from the same weights. fp32 tolerance: loss
// rtol 1e-6; every gradient rtol 1e-4, atol 1e-6 (the kernels sum in different orders).
TEST(GptModel, FusedAndExplicitAttentionGiveTheSameLossAndGradients) {
  GptConfig c = small();
  std::vector<std::pair<double, std::vector<at::Tensor>>> runs;
  for (const bool fused : {true, false}) {
    c.fused_attention = fused;
    at::manual_seed(3);
    Gpt model(c);
    at::manual_seed(4);
    at::Tensor idx = at::randint(61, {3, 16}, at::kLong);
    at::Tensor targets = at::randint(61, {3, 16}, at::kLong);
    at::Tensor loss = model->loss(idx, targets, /*fused=*/false);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
    runs.emplace_back(loss.item<double>(), grads);
  }
  EXPECT_NEAR(runs[0].first, runs[1].first, 1e-6 * std::abs(runs[1].first));
  const auto names = Gpt(c)->named_parameters().keys();
  ASSERT_EQ(runs[0].second.size(), runs[1].second.size());
  for (size_t i = 0; i < runs[0].second.size(); ++i) {
    const at::Tensor& a = runs[0].second[i];
    const at::Tensor& b = runs[1].second[i];
    EXPECT_TRUE(at::allclose(a, b, 1e-4, 1e-6))
        << names[i] << ": max |diff| " << (a - b).abs().max().item<double>();
  }
}

TEST(GptModel, Gpt2Initialization) {
  GptConfig c = small();
  c.dim = 256;
  c.heads = 4;
  c.layers = 8;
  at::manual_seed(3);
  Gpt model(c);
  auto std_of = [](const at::Tensor& t) { return t.std().item<double>(); };
  EXPECT_NEAR(std_of(model->wte->weight), 0.02, 0.002);
  EXPECT_NEAR(std_of(model->wpe->weight), 0.02, 0.004);
  const double residual = 0.02 / std::sqrt(2.0 * 8);
  for (auto& block : model->blocks) {
    EXPECT_NEAR(std_of(block->attn->c_attn->weight), 0.02, 0.001);
    EXPECT_NEAR(std_of(block->mlp->c_fc->weight), 0.02, 0.001);
    EXPECT_NEAR(std_of(block->attn->c_proj->weight), residual, residual * 0.05);
    EXPECT_NEAR(std_of(block->mlp->c_proj->weight), residual, residual * 0.05);
    EXPECT_EQ(block->attn->c_attn->bias.abs().max().item<double>(), 0.0);
    EXPECT_EQ(block->mlp->c_proj->bias.abs().max().item<double>(), 0.0);
    EXPECT_TRUE(at::equal(block->ln_1->weight, at::ones_like(block->ln_1->weight)));
    EXPECT_EQ(block->ln_2->bias.abs().max().item<double>(), 0.0);
  }
}

TEST(GptModel, BlocksAreNamedLikeGpt2) {
  at::manual_seed(0);
  Gpt model(small());
  auto params = model->named_parameters();
  for (const char* name : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.1.attn.c_attn.weight",
                           "h.1.attn.c_proj.bias", "h.0.mlp.c_fc.weight", "ln_f.bias"}) {
    EXPECT_NE(params.find(name), nullptr) << name;
  }
  // FSDP's wrap_modules_named("BlockImpl") must find exactly the blocks.
  int blocks = 0;
  for (const auto& m : model->modules(/*include_self=*/false)) {
    if (m->name().find("BlockImpl") != std::string::npos) ++blocks;
  }
  EXPECT_EQ(blocks, 2);
}

}  // namespace
}  // namespace gpt2

// --export / --init_from: Hugging Face GPT-2 names and Conv1D layouts, and a bit-for-bit
// round trip through the file.
namespace gpt2 {
namespace {

TEST(HfWeights, ExportHasGpt2NamesAndLayoutsAndRoundTripsBitForBit) {
  GptConfig c;
  c.layers = 2;
  c.heads = 2;
  c.dim = 16;
  c.context = 8;
  c.vocab_size = 40;
  at::manual_seed(3);
  Gpt a(c);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& item : a->named_parameters()) params.emplace_back(item.key(), item.value());
  const std::string path = ::testing::TempDir() + "hf_weights_test.safetensors";
  export_hf_safetensors(path, params);

  dtrain::SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  const std::map<std::string, std::vector<int64_t>> want = {
      {"transformer.wte.weight", {40, 16}},
      {"transformer.wpe.weight", {8, 16}},
      {"transformer.h.0.ln_1.weight", {16}},
      {"transformer.h.0.attn.c_attn.weight", {16, 48}},
      {"transformer.h.0.attn.c_attn.bias", {48}},
      {"transformer.h.0.attn.c_proj.weight", {16, 16}},
      {"transformer.h.1.mlp.c_fc.weight", {16, 64}},
      {"transformer.h.1.mlp.c_proj.weight", {64, 16}},
      {"transformer.ln_f.bias", {16}}};
  for (const auto& [name, shape] : want) {
    const auto* t = r.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, shape) << name;
    EXPECT_EQ(t->dtype, at::kFloat) << name;
  }
  EXPECT_EQ(r.find("lm_head.weight"), nullptr);  // tied to wte, as save_pretrained leaves it
  EXPECT_EQ(r.tensors().size(), params.size());

  at::manual_seed(4);
  Gpt b(c);
  init_from_hf_safetensors(path, b);
  for (const auto& item : a->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), b->named_parameters()[item.key()])) << item.key();
  }
  // Written again from the loaded model: the same bytes.
  const std::string again = path + ".2";
  std::vector<std::pair<std::string, at::Tensor>> params_b;
  for (const auto& item : b->named_parameters()) params_b.emplace_back(item.key(), item.value());
  export_hf_safetensors(again, params_b);
  std::ifstream f1(path, std::ios::binary), f2(again, std::ios::binary);
  std::string s1((std::istreambuf_iterator<char>(f1)), {}),
      s2((std::istreambuf_iterator<char>(f2)), {});
  EXPECT_EQ(s1, s2);

  // Another shape is refused, naming the file and the tensor.
  c.dim = 24;
  Gpt other(c);
  try {
    init_from_hf_safetensors(path, other);
    ADD_FAILURE() << "loaded a mismatched file";
  } catch (const dtrain::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": transformer.wte.weight has shape [40, 16]"),
              std::string::npos)
        << e.what();
  }
  std::remove(path.c_str());
  std::remove(again.c_str());
}

}  // namespace
}  // namespace gpt2

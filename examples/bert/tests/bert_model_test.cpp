// Tests of the BERT encoder: preset sizes, the stock layers in a Sequential, the tied head,
// bidirectional attention, BERT's initialization, the MLM loss, and that a tiny model learns.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <string>

#include "bert_model.h"
#include "dtrain/errors.h"
#include "mlm_data.h"
#include "model.h"

namespace bert {
namespace {

BertConfig small() {
  BertConfig c;
  c.vocab_size = 61;
  c.context = 16;
  c.layers = 2;
  c.heads = 2;
  c.dim = 32;
  c.ffn_dim = 64;
  return c;
}

int64_t numel_of_parameters(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

TEST(BertModel, PresetSizes) {
  EXPECT_EQ(count_parameters(preset("bert")), 46716544);  // the report's BERT: 46.7M
  EXPECT_EQ(count_parameters(preset("bert-tiny")), 16058368);
  EXPECT_TRUE(is_preset("bert"));
  EXPECT_FALSE(is_preset("tiny"));
  EXPECT_THROW(preset("bert-huge"), dtrain::InvalidArgument);
  at::manual_seed(0);
  Bert model(preset("bert-tiny"));
  EXPECT_EQ(numel_of_parameters(*model), count_parameters(preset("bert-tiny")));
  Bert s(small());
  EXPECT_EQ(numel_of_parameters(*s), count_parameters(small()));
  BertConfig bad = small();
  bad.heads = 3;
  EXPECT_THROW(Bert{bad}, dtrain::InvalidArgument);
}

// The layers are LibTorch's own TransformerEncoderLayer, in a Sequential, under the names
// FSDP's wrap_modules_named("TransformerEncoderLayer") finds; no head parameter.
TEST(BertModel, StockEncoderLayersInASequential) {
  at::manual_seed(0);
  Bert model(small());
  ASSERT_EQ(model->layers->size(), 2u);
  for (size_t i = 0; i < model->layers->size(); ++i) {
    EXPECT_NE(model->layers->ptr(i)->as<torch::nn::TransformerEncoderLayer>(), nullptr);
  }
  auto params = model->named_parameters();
  for (const char* name :
       {"tok_embed.weight", "pos_embed.weight", "layers.0.self_attn.in_proj_weight",
        "layers.0.self_attn.out_proj.weight", "layers.1.linear1.weight", "layers.1.linear2.bias",
        "layers.1.norm2.weight", "ln_f.bias"}) {
    EXPECT_NE(params.find(name), nullptr) << name;
  }
  for (const auto& item : params) EXPECT_EQ(item.key().find("head"), std::string::npos);
  int units = 0;
  for (const auto& m : model->modules(/*include_self=*/false)) {
    if (m->name().find("TransformerEncoderLayer") != std::string::npos) ++units;
  }
  EXPECT_EQ(units, 2);
}

TEST(BertModel, HeadIsTiedToTokenEmbedding) {
  at::manual_seed(0);
  Bert model(small());
  {
    c10::NoGradGuard no_grad;
    model->tok_embed->weight.zero_();
  }
  EXPECT_EQ(model->forward(at::zeros({1, 4}, at::kLong)).abs().max().item<double>(), 0.0);
}

// Unlike GPT-2, every position sees every other: a later token changes earlier outputs.
TEST(BertModel, AttentionIsBidirectional) {
  at::manual_seed(2);
  Bert model(small());
  c10::NoGradGuard no_grad;
  at::Tensor a = at::randint(61, {2, 12}, at::kLong);
  at::Tensor b = a.clone();
  b.select(1, 11).fill_(60);
  a.select(1, 11).fill_(59);
  at::Tensor la = model->forward(a), lb = model->forward(b);
  EXPECT_EQ(la.sizes(), (std::vector<int64_t>{2, 12, 61}));
  EXPECT_FALSE(at::allclose(la.narrow(1, 0, 1), lb.narrow(1, 0, 1), 1e-5, 1e-6));
  EXPECT_THROW(model->forward(at::zeros({1, 17}, at::kLong)), dtrain::InvalidArgument);
}

TEST(BertModel, BertInitialization) {
  BertConfig c = small();
  c.dim = 256;
  c.heads = 4;
  c.ffn_dim = 512;
  at::manual_seed(3);
  Bert model(c);
  auto std_of = [](const at::Tensor& t) { return t.std().item<double>(); };
  auto params = model->named_parameters();
  for (const char* name :
       {"tok_embed.weight", "pos_embed.weight", "layers.0.self_attn.in_proj_weight",
        "layers.1.linear1.weight", "layers.1.self_attn.out_proj.weight"}) {
    EXPECT_NEAR(std_of(params[name]), 0.02, 0.003) << name;
  }
  for (const char* name : {"layers.0.self_attn.in_proj_bias", "layers.0.linear2.bias",
                           "layers.1.norm1.bias", "ln_f.bias"}) {
    EXPECT_EQ(params[name].abs().max().item<double>(), 0.0) << name;
  }
  for (const char* name : {"layers.0.norm1.weight", "layers.1.norm2.weight", "ln_f.weight"}) {
    EXPECT_TRUE(at::equal(params[name], at::ones_like(params[name]))) << name;
  }
}

// Only predicted positions count: the loss is cross-entropy over them, fused or not.
TEST(BertModel, MlmLossCountsOnlyPredictedPositions) {
  at::manual_seed(4);
  Bert model(small());
  const at::Tensor idx = at::randint(60, {3, 16}, at::kLong);
  at::Tensor targets = at::full({3, 16}, kIgnoreTarget, at::kLong);
  targets.index_put_({0, 2}, 7);
  targets.index_put_({1, 5}, 11);
  targets.index_put_({2, 15}, 3);
  const at::Tensor logits = model->forward(idx);
  const double want =
      (at::cross_entropy_loss(logits[0][2].unsqueeze(0), at::full({1}, 7, at::kLong)) +
       at::cross_entropy_loss(logits[1][5].unsqueeze(0), at::full({1}, 11, at::kLong)) +
       at::cross_entropy_loss(logits[2][15].unsqueeze(0), at::full({1}, 3, at::kLong)))
          .item<double>() /
      3.0;
  EXPECT_NEAR(model->loss(idx, targets, /*fused=*/false).item<double>(), want, 1e-5 * want);
  EXPECT_NEAR(model->loss(idx, targets, /*fused=*/true).item<double>(), want, 1e-5 * want);
  // Gradients of the two paths agree too.
  model->zero_grad();
  model->loss(idx, targets, true).backward();
  const at::Tensor fused_grad = model->tok_embed->weight.grad().clone();
  model->zero_grad();
  model->loss(idx, targets, false).backward();
  EXPECT_TRUE(at::allclose(model->tok_embed->weight.grad(), fused_grad, 1e-4, 1e-6));
  EXPECT_THROW(model->loss(idx, at::full({3, 16}, kIgnoreTarget, at::kLong)),
               dtrain::InvalidArgument);
}

// Activation checkpointing recomputes each layer in backward: same loss, same gradients, and
// the same parameters (no module added or renamed).
TEST(BertModel, ActivationCheckpointingKeepsLossAndGradients) {
  BertConfig c = small();
  at::manual_seed(6);
  Bert plain(c);
  c.activation_checkpointing = true;
  at::manual_seed(6);
  Bert checkpointed(c);
  const at::Tensor idx = at::randint(60, {3, 16}, at::kLong);
  at::Tensor targets = at::full({3, 16}, kIgnoreTarget, at::kLong);
  targets.index_put_({0, 2}, 7);
  targets.index_put_({1, 9}, 11);
  targets.index_put_({2, 0}, 3);
  const at::Tensor a = plain->loss(idx, targets);
  const at::Tensor b = checkpointed->loss(idx, targets);
  EXPECT_EQ(a.item<double>(), b.item<double>());
  a.backward();
  b.backward();
  const auto want = plain->named_parameters();
  const auto got = checkpointed->named_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& item : want) {
    const at::Tensor* g = got.find(item.key());
    ASSERT_NE(g, nullptr) << item.key();
    ASSERT_TRUE(g->grad().defined()) << item.key();
    EXPECT_TRUE(at::allclose(g->grad(), item.value().grad(), 1e-5, 1e-7)) << item.key();
  }
}

// dtrain's forward of the stock layers with the fused attention (at::scaled_dot_product_attention
// on LibTorch 2.x, the explicit one on 1.13) against LibTorch's own TransformerEncoderLayer
// forward, from the same weights: the same loss and gradients. fp32 tolerance: loss rtol 1e-6;
// every gradient rtol 1e-4, atol 1e-6 (the two sum in different orders). Also in training mode
// with dropout 0, and with activation checkpointing.
TEST(BertModel, FusedAttentionMatchesTheStockLayers) {
  for (const bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "activation checkpointing" : "plain");
    BertConfig c = small();
    c.activation_checkpointing = checkpointing;
    c.fused_attention = false;
    at::manual_seed(6);
    Bert stock(c);
    c.fused_attention = true;
    at::manual_seed(6);
    Bert fused(c);
    const at::Tensor idx = at::randint(60, {3, 16}, at::kLong);
    at::Tensor targets = at::randint(60, {3, 16}, at::kLong);
    targets.index_put_({0, 2}, kIgnoreTarget);
    const at::Tensor a = stock->loss(idx, targets, /*fused=*/false);
    const at::Tensor b = fused->loss(idx, targets, /*fused=*/false);
    EXPECT_NEAR(b.item<double>(), a.item<double>(), 1e-6 * std::abs(a.item<double>()));
    a.backward();
    b.backward();
    const auto want = stock->named_parameters();
    const auto got = fused->named_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& item : want) {
      const at::Tensor* g = got.find(item.key());
      ASSERT_NE(g, nullptr) << item.key();
      ASSERT_TRUE(g->grad().defined()) << item.key();
      EXPECT_TRUE(at::allclose(g->grad(), item.value().grad(), 1e-4, 1e-6))
          << item.key() << ": max |diff| "
          << (g->grad() - item.value().grad()).abs().max().item<double>();
    }
  }
}

// A tiny BERT learns to fill in masked tokens from their context: in this text every
// 16-token sequence repeats one of 13 tokens, so the masked token is whatever the rest of the
// sequence holds. The MLM loss must fall from ln 61 ~ 4.1 far below the 2.56 nats (ln 13) of a
// model that ignored the context.
TEST(BertModel, LossDecreasesOnATinyRun) {
  at::manual_seed(5);
  Bert model(small());
  std::vector<uint16_t> text;
  for (int i = 0; i < 2000; ++i) {
    const int run = i / 16;  // the sampler's sequences start every 16 tokens
    text.push_back(static_cast<uint16_t>((run * 7 + run * run) % 13));
  }
  const gpt2::TokenView tokens(text);
  gpt2::SamplerOptions so;
  so.seq_len = 16;
  so.batch_size = 8;
  gpt2::DistributedSampler sampler(tokens.size(), so);
  MaskingOptions mo;
  mo.mask_id = 60;
  mo.random_vocab = 60;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  for (int64_t step = 0; step < 100; ++step) {
    sampler.set_epoch(step / sampler.steps_per_epoch());
    const gpt2::Batch b = load_mlm_batch(tokens, sampler, step % sampler.steps_per_epoch(), mo);
    opt.zero_grad();
    at::Tensor loss = model->loss(b.inputs, b.targets);
    loss.backward();
    opt.step();
    if (step < 5) first += loss.item<double>() / 5;
    if (step >= 95) last += loss.item<double>() / 5;
  }
  EXPECT_NEAR(first, std::log(61.0), 0.5);
  EXPECT_LT(last, 1.0) << "first " << first << " last " << last;
}

}  // namespace
}  // namespace bert

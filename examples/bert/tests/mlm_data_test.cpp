// Tests of the BERT example's masked-language-model batches: BERT's 15% / 80-10-10 masking,
// determinism per (seed, sample), and batches that do not depend on the world size.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <dtrain/errors.h>

#include "data.h"
#include "mlm_data.h"

namespace bert {
namespace {

constexpr int64_t kVocab = 1000;

MaskingOptions options(uint64_t seed = 5) {
  MaskingOptions o;
  o.mask_id = kVocab;
  o.random_vocab = kVocab;
  o.seed = seed;
  return o;
}

std::vector<uint64_t> ids(int64_t first, int64_t n) {
  std::vector<uint64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<uint64_t>(first + i));
  return out;
}

TEST(MlmMasking, PredictedPositionsPerSequence) {
  EXPECT_EQ(predicted_per_sequence(128, options()), 19);  // BERT: round(128 * 0.15)
  EXPECT_EQ(predicted_per_sequence(32, options()), 5);
  EXPECT_EQ(predicted_per_sequence(3, options()), 1);  // never none
  MaskingOptions all = options();
  all.mask_fraction = 1.0;
  EXPECT_EQ(predicted_per_sequence(7, all), 7);
}

// Over 2000 sequences of 128 tokens: exactly 19 predicted positions each, spread over all
// positions; among them 80% [MASK], 10% random and 10% unchanged; nothing else changes.
TEST(MlmMasking, BertStatistics) {
  const int64_t rows = 2000, T = 128;
  const at::Tensor tokens = at::randint(kVocab, {rows, T}, at::kLong);
  const gpt2::Batch b = mask_tokens(tokens, ids(0, rows), options());
  ASSERT_EQ(b.inputs.sizes(), tokens.sizes());
  ASSERT_EQ(b.targets.sizes(), tokens.sizes());
  EXPECT_EQ(b.inputs.scalar_type(), at::kLong);
  EXPECT_EQ(b.targets.scalar_type(), at::kLong);

  const at::Tensor predicted = b.targets.ne(kIgnoreTarget);
  EXPECT_TRUE(at::equal(predicted.sum(1), at::full({rows}, 19, at::kLong)));
  // Targets are the original tokens; unpredicted inputs are untouched.
  EXPECT_TRUE(at::equal(b.targets.masked_select(predicted), tokens.masked_select(predicted)));
  EXPECT_TRUE(at::equal(b.inputs.masked_select(~predicted), tokens.masked_select(~predicted)));
  EXPECT_EQ(b.targets.masked_select(~predicted).ne(kIgnoreTarget).sum().item<int64_t>(), 0);

  const at::Tensor in = b.inputs.masked_select(predicted), orig = tokens.masked_select(predicted);
  const double n = static_cast<double>(in.numel());  // 38000: one standard deviation ~0.002
  const double masked = in.eq(kVocab).sum().item<double>() / n;
  const double unchanged = in.eq(orig).sum().item<double>() / n;
  const double random = 1.0 - masked - unchanged;
  EXPECT_NEAR(masked, 0.8, 0.01);
  EXPECT_NEAR(random, 0.1 * (1.0 - 1.0 / kVocab), 0.01);  // a random draw may hit the original
  EXPECT_NEAR(unchanged, 0.1, 0.01);
  EXPECT_EQ(in.ge(kVocab + 1).sum().item<int64_t>(), 0);
  EXPECT_EQ(in.lt(0).sum().item<int64_t>(), 0);
  // Every position is predicted about 15% of the time (300 of 2000, sd ~16).
  const at::Tensor per_position = predicted.sum(0);
  EXPECT_GT(per_position.min().item<int64_t>(), 220);
  EXPECT_LT(per_position.max().item<int64_t>(), 380);
  // The input tensor is not modified.
  EXPECT_EQ(tokens.eq(kVocab).sum().item<int64_t>(), 0);
}

// A row's mask depends on the seed and its sample id only, not on its row or its batch.
TEST(MlmMasking, DeterministicPerSeedAndSample) {
  const at::Tensor tokens = at::randint(kVocab, {6, 64}, at::kLong);
  const gpt2::Batch a = mask_tokens(tokens, ids(100, 6), options());
  const gpt2::Batch again = mask_tokens(tokens, ids(100, 6), options());
  EXPECT_TRUE(at::equal(a.inputs, again.inputs));
  EXPECT_TRUE(at::equal(a.targets, again.targets));

  const gpt2::Batch reversed =
      mask_tokens(tokens.flip(0), {105, 104, 103, 102, 101, 100}, options());
  EXPECT_TRUE(at::equal(reversed.inputs.flip(0), a.inputs));
  EXPECT_TRUE(at::equal(reversed.targets.flip(0), a.targets));
  const gpt2::Batch one = mask_tokens(tokens.narrow(0, 3, 1), {103}, options());
  EXPECT_TRUE(at::equal(one.targets, a.targets.narrow(0, 3, 1)));

  const gpt2::Batch other_samples = mask_tokens(tokens, ids(200, 6), options());
  EXPECT_FALSE(at::equal(other_samples.targets, a.targets));
  const gpt2::Batch other_seed = mask_tokens(tokens, ids(100, 6), options(6));
  EXPECT_FALSE(at::equal(other_seed.targets, a.targets));
  // Same tokens, different sample ids in one batch: different masks per row.
  const gpt2::Batch same_rows =
      mask_tokens(tokens.narrow(0, 0, 1).expand({6, 64}).contiguous(), ids(0, 6), options());
  EXPECT_FALSE(at::equal(same_rows.targets[0], same_rows.targets[1]));
}

gpt2::TokenView random_tokens(int64_t n) { return gpt2::make_random_tokens(n, kVocab, 3); }

gpt2::SamplerOptions sampler_options(int64_t batch, int rank, int world) {
  gpt2::SamplerOptions o;
  o.seq_len = 16;
  o.batch_size = batch;
  o.rank = rank;
  o.world_size = world;
  o.seed = 9;
  return o;
}

// Ranks together load exactly the masked global batch one process loads, for every world
// size: what lets DDP and FSDP follow single-device training.
TEST(MlmBatch, RanksTogetherLoadTheSingleProcessBatch) {
  const gpt2::TokenView tokens = random_tokens(4001);
  for (int world = 2; world <= 4; ++world) {
    gpt2::DistributedSampler single(tokens.size(), sampler_options(2 * world, 0, 1));
    single.set_epoch(1);
    const gpt2::Batch want = load_mlm_batch(tokens, single, 3, options());
    std::vector<at::Tensor> inputs, targets;
    for (int r = 0; r < world; ++r) {
      gpt2::DistributedSampler s(tokens.size(), sampler_options(2, r, world));
      s.set_epoch(1);
      const gpt2::Batch b = load_mlm_batch(tokens, s, 3, options());
      inputs.push_back(b.inputs);
      targets.push_back(b.targets);
    }
    EXPECT_TRUE(at::equal(at::cat(inputs, 0), want.inputs)) << "world " << world;
    EXPECT_TRUE(at::equal(at::cat(targets, 0), want.targets)) << "world " << world;
  }
}

// The masked batch is the sampler's sequences, masked; another epoch masks them anew.
TEST(MlmBatch, MasksTheSamplersSequencesAnewEachEpoch) {
  const gpt2::TokenView tokens = random_tokens(4001);
  gpt2::SamplerOptions o = sampler_options(4, 0, 1);
  o.shuffle = false;  // the same sequences in every epoch
  gpt2::DistributedSampler s(tokens.size(), o);
  const gpt2::Batch plain = gpt2::load_batch(tokens, s, 2);
  const gpt2::Batch epoch0 = load_mlm_batch(tokens, s, 2, options());
  const at::Tensor predicted = epoch0.targets.ne(kIgnoreTarget);
  EXPECT_TRUE(
      at::equal(epoch0.inputs.masked_select(~predicted), plain.inputs.masked_select(~predicted)));
  EXPECT_TRUE(
      at::equal(epoch0.targets.masked_select(predicted), plain.inputs.masked_select(predicted)));
  s.set_epoch(1);
  const gpt2::Batch epoch1 = load_mlm_batch(tokens, s, 2, options());
  EXPECT_FALSE(at::equal(epoch1.targets, epoch0.targets));
  s.set_epoch(0);
  EXPECT_TRUE(at::equal(load_mlm_batch(tokens, s, 2, options()).targets, epoch0.targets));
}

TEST(MlmMasking, RejectsBadArguments) {
  const at::Tensor tokens = at::zeros({2, 8}, at::kLong);
  EXPECT_THROW(mask_tokens(tokens, ids(0, 3), options()), dtrain::InvalidArgument);
  EXPECT_THROW(mask_tokens(tokens.to(at::kInt), ids(0, 2), options()), dtrain::InvalidArgument);
  EXPECT_THROW(mask_tokens(tokens.reshape({16}), ids(0, 16), options()), dtrain::InvalidArgument);
  MaskingOptions bad = options();
  bad.mask_fraction = 0;
  EXPECT_THROW(mask_tokens(tokens, ids(0, 2), bad), dtrain::InvalidArgument);
  bad = options();
  bad.mask_token_share = 0.95;  // + 0.1 random > 1
  EXPECT_THROW(mask_tokens(tokens, ids(0, 2), bad), dtrain::InvalidArgument);
  bad = options();
  bad.random_vocab = 0;
  EXPECT_THROW(mask_tokens(tokens, ids(0, 2), bad), dtrain::InvalidArgument);
}

}  // namespace
}  // namespace bert

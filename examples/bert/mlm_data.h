// Masked-language-model batches for the BERT example, on the GPT-2 example's corpus,
// tokenizer and distributed sampler (data.h).
//
// Masking follows BERT's create_pretraining_data: each sequence of T tokens gets exactly
// round(T * mask_fraction) predicted positions (15%: 19 of 128), drawn without replacement;
// of those, 80% become [MASK], 10% a random token and 10% keep their token. Targets hold the
// original token at predicted positions and kIgnoreTarget elsewhere.
//
// The masks are a pure function of (seed, sample), drawn with SplitMix64, so every strategy,
// world size and row position sees the same masked batch for the same sequence. Because
// every sequence has the same number of predicted positions, the mean loss over one rank's
// rows, averaged over equal ranks, equals the mean over the global batch: DDP and FSDP match
// single-device training.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "data.h"

namespace bert {

// Target of a position that is not predicted (cross_entropy's ignore_index convention).
constexpr int64_t kIgnoreTarget = -100;

struct MaskingOptions {
  // The [MASK] id: one past the tokenizer's ids (GPT-2: 50257), so the model has
  // vocabulary + 1 embedding rows.
  int64_t mask_id = 50257;
  // Random replacements are drawn uniformly from [0, random_vocab): the tokenizer's ids.
  int64_t random_vocab = 50257;
  // Share of a sequence's positions that are predicted (at least one per sequence).
  double mask_fraction = 0.15;
  // Of the predicted positions: the share replaced by [MASK] and the share replaced by a
  // random token; the rest keep their token.
  double mask_token_share = 0.8;
  double random_token_share = 0.1;
  uint64_t seed = 0;

  // Throws dtrain::InvalidArgument for ids < 0 or random_vocab < 1, mask_fraction outside
  // (0, 1], or shares outside [0, 1] or summing to more than 1.
  void validate() const;
};

// Predicted positions in every sequence of `seq_len` tokens: max(1, round(seq_len * fraction)).
int64_t predicted_per_sequence(int64_t seq_len, const MaskingOptions& options);

// Masks int64 tokens [B, T]; row i is masked as sample `samples[i]` (any id that names the
// sequence, e.g. its index in the corpus). Returns {inputs: masked tokens, targets: original
// tokens at predicted positions, kIgnoreTarget elsewhere}. `tokens` is not modified. Throws
// dtrain::InvalidArgument when `tokens` is not a CPU int64 [B, T] tensor or `samples` does
// not have B entries.
gpt2::Batch mask_tokens(const at::Tensor& tokens, const std::vector<uint64_t>& samples,
                        const MaskingOptions& options);

// The sample id load_mlm_batch gives sequence `sequence` in epoch `epoch`: a new mask every
// epoch (RoBERTa's dynamic masking), the same one on every rank and for every strategy.
uint64_t mlm_sample_id(int64_t epoch, int64_t sequence, int64_t num_sequences);

// This rank's MLM batch of `step` in the sampler's current epoch: the T tokens at each of
// the sampler's offsets, masked as sample mlm_sample_id(epoch, offset / T, ...).
gpt2::Batch load_mlm_batch(const gpt2::TokenView& tokens, const gpt2::DistributedSampler& sampler,
                           int64_t step, const MaskingOptions& options);

}  // namespace bert

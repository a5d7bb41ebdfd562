#include "mlm_data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include <dtrain/errors.h>

#include "split_mix64.h"

namespace bert {

void MaskingOptions::validate() const {
  const auto fail = [](const std::string& why) {
    throw dtrain::InvalidArgument("MLM masking: " + why);
  };
  if (mask_id < 0 || random_vocab < 1) fail("mask_id must be >= 0 and random_vocab >= 1");
  if (!(mask_fraction > 0.0 && mask_fraction <= 1.0)) {
    fail("mask_fraction must be in (0, 1], got " + std::to_string(mask_fraction));
  }
  if (!(mask_token_share >= 0.0 && random_token_share >= 0.0 &&
        mask_token_share + random_token_share <= 1.0)) {
    fail("mask_token_share and random_token_share must be >= 0 with a sum <= 1");
  }
}

int64_t predicted_per_sequence(int64_t seq_len, const MaskingOptions& options) {
  const auto k =
      static_cast<int64_t>(std::llround(static_cast<double>(seq_len) * options.mask_fraction));
  return std::clamp<int64_t>(k, 1, seq_len);
}

gpt2::Batch mask_tokens(const at::Tensor& tokens, const std::vector<uint64_t>& samples,
                        const MaskingOptions& options) {
  options.validate();
  if (tokens.dim() != 2 || tokens.scalar_type() != at::kLong || !tokens.device().is_cpu()) {
    throw dtrain::InvalidArgument("mask_tokens: tokens must be a CPU int64 [B, T] tensor");
  }
  const int64_t rows = tokens.size(0), T = tokens.size(1);
  if (static_cast<int64_t>(samples.size()) != rows) {
    throw dtrain::InvalidArgument("mask_tokens: " + std::to_string(samples.size()) +
                                  " sample ids for " + std::to_string(rows) + " rows");
  }
  gpt2::Batch batch{tokens.contiguous().clone(), at::full({rows, T}, kIgnoreTarget, at::kLong)};
  if (T == 0) return batch;
  const int64_t k = predicted_per_sequence(T, options);
  int64_t* in = batch.inputs.data_ptr<int64_t>();
  int64_t* target = batch.targets.data_ptr<int64_t>();
  std::vector<int64_t> positions(T);
  for (int64_t r = 0; r < rows; ++r) {
    gpt2::SplitMix64 rng(gpt2::SplitMix64::stream_seed(options.seed, samples[r]));
    std::iota(positions.begin(), positions.end(), int64_t{0});
    // The first k entries of a partial Fisher-Yates shuffle: k distinct positions.
    for (int64_t i = 0; i < k; ++i) {
      std::swap(positions[i], positions[i + rng.below(static_cast<uint64_t>(T - i))]);
      const int64_t p = r * T + positions[i];
      target[p] = in[p];
      const double u = rng.uniform();
      if (u < options.mask_token_share) {
        in[p] = options.mask_id;
      } else if (u < options.mask_token_share + options.random_token_share) {
        in[p] = static_cast<int64_t>(rng.below(static_cast<uint64_t>(options.random_vocab)));
      }
    }
  }
  return batch;
}

uint64_t mlm_sample_id(int64_t epoch, int64_t sequence, int64_t num_sequences) {
  return static_cast<uint64_t>(epoch) * static_cast<uint64_t>(num_sequences) +
         static_cast<uint64_t>(sequence);
}

gpt2::Batch load_mlm_batch(const gpt2::TokenView& tokens, const gpt2::DistributedSampler& sampler,
                           int64_t step, const MaskingOptions& options) {
  const int64_t T = sampler.options().seq_len;
  const std::vector<int64_t> offsets = sampler.rank_offsets(step);
  std::vector<uint64_t> samples;
  samples.reserve(offsets.size());
  for (const int64_t o : offsets) {
    samples.push_back(mlm_sample_id(sampler.epoch(), o / T, sampler.num_sequences()));
  }
  return mask_tokens(gpt2::make_batch(tokens, offsets, T).inputs, samples, options);
}

}  // namespace bert

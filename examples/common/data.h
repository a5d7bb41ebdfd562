// The GPT-2 example's data pipeline: a corpus tokenized once into a cached token file, a
// train/validation split, and a distributed sampler whose ranks together read exactly
// the global batch a single process would read.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "token_cache.h"
#include "tokenizer.h"

namespace gpt2 {

// A read-only run of tokens that shares ownership of its storage, so splits and slices
// cost nothing. Tokens are uint16: every vocabulary here has at most 65536 ids.
class TokenView {
 public:
  TokenView() = default;
  explicit TokenView(std::vector<uint16_t> tokens);

  int64_t size() const { return size_; }
  const uint16_t* data() const { return storage_ ? storage_->data() + begin_ : nullptr; }
  uint16_t operator[](int64_t i) const { return data()[i]; }  // unchecked
  // Tokens [begin, begin + size) of this view. Throws dtrain::InvalidArgument when out of
  // range.
  TokenView slice(int64_t begin, int64_t size) const;
  std::vector<uint16_t> to_vector() const { return {data(), data() + size_}; }

 private:
  std::shared_ptr<const std::vector<uint16_t>> storage_;
  int64_t begin_ = 0;
  int64_t size_ = 0;
};

// ---- Tokenizing a corpus ------------------------------------------------------------

// Tokenizes `source` without any cache. A file is one text whose documents are separated
// by kEndOfText (see encode_documents()); a folder is its regular *.txt files in byte-wise
// name order (not recursive), each one document, joined by tokenizer.eot(). Both spellings
// of the SOTU corpus from scripts/fetch-data.sh (sotu.txt and sotu/) give the same tokens.
// Throws dtrain::Error when `source` cannot be read (a missing source: the message names
// scripts/fetch-data.sh), dtrain::InvalidArgument when the vocabulary does not fit uint16.
std::vector<uint16_t> tokenize_source(const std::filesystem::path& source,
                                      const Tokenizer& tokenizer);

struct TokenCacheOptions {
  // Folder of the cache file; empty means next to the source. The file is named
  // "<source file name>.<tokenizer name>.tokens", so two sources with the same file name
  // need different folders.
  std::filesystem::path cache_dir;
  // Tokenize even when a valid cache exists.
  bool force = false;
  // Receives warnings (a corrupt cache being rebuilt, a cache that cannot be written); null
  // prints them on stderr as "warning: ...".
  std::function<void(const std::string&)> warn;
};

struct LoadedTokens {
  TokenView tokens;
  std::filesystem::path cache_path;
  bool from_cache = false;     // false when this call tokenized the source
  bool cache_written = false;  // this call tokenized and stored the cache
};

// The tokens of `source` (as tokenize_source()), tokenized at most once: the result is
// stored in a binary cache file (see encode_token_cache()) and reused while its key
// matches. The key covers the source's absolute path, the size and modification time of
// every file read, and the tokenizer's name and vocabulary size, so editing the source
// re-tokenizes it. The file is written to a temporary name and renamed, so concurrent
// writers (several ranks on one machine) leave a complete file; let one rank load first to
// tokenize only once.
//
// A cache that is stale (other key, vocabulary or format version) is rebuilt silently; one
// that is corrupt (bad magic, header or token checksum, a size that does not match its
// token count, an id outside the vocabulary) is rebuilt with a warning naming it and the
// problem. A cache that cannot be written (read-only folder, disk full) is a warning: the
// tokens are returned from memory.
LoadedTokens load_tokens(const std::filesystem::path& source, const Tokenizer& tokenizer,
                         const TokenCacheOptions& options = {});

// `num_tokens` tokens drawn uniformly from [0, vocab_size) by a generator seeded with
// `seed`; the same on every machine and standard library. For throughput runs (--data
// random) that need no corpus.
TokenView make_random_tokens(int64_t num_tokens, int64_t vocab_size, uint64_t seed);

// ---- Splitting and sampling ---------------------------------------------------------

struct TrainValSplit {
  TokenView train;
  TokenView val;
};

// The last floor(size * val_fraction) tokens become the validation set, the rest the
// training set; contiguous, so no sequence straddles the two. val_fraction is in [0, 1).
TrainValSplit split_train_val(const TokenView& tokens, double val_fraction = 0.05);

struct SamplerOptions {
  int64_t seq_len = 1024;  // T: tokens per sequence (inputs; targets are shifted by one)
  int64_t batch_size = 8;  // B: sequences per rank per step
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;  // false: sequences in corpus order (e.g. for validation)
};

// Cuts a token run into sequences that start every seq_len tokens (sequence k at offset
// o = k * T; inputs tokens[o, o+T), targets tokens[o+1, o+T+1), so each reads T + 1 tokens
// and the inputs of different sequences never overlap) and deals them out in global batches of
// batch_size * world_size sequences. The order is a permutation that depends only on (seed, epoch),
// so it is the same on every rank; rank r reads rows [r*B, (r+1)*B) of each global batch. Hence N
// ranks together read exactly the global batch one rank with batch_size * N reads, in the same row
// order. The last incomplete global batch of an epoch is dropped.
class DistributedSampler {
 public:
  // Throws dtrain::InvalidArgument for invalid options or when num_tokens does not hold a
  // single global batch.
  DistributedSampler(int64_t num_tokens, const SamplerOptions& options);

  // Selects the epoch whose permutation the offsets come from (initially 0).
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }

  int64_t num_sequences() const { return num_sequences_; }
  int64_t global_batch_size() const { return options_.batch_size * options_.world_size; }
  int64_t steps_per_epoch() const { return num_sequences_ / global_batch_size(); }
  const SamplerOptions& options() const { return options_; }

  // Start offsets of the whole global batch of `step` in [0, steps_per_epoch()), in row
  // order.
  std::vector<int64_t> global_offsets(int64_t step) const;
  // This rank's batch_size offsets of `step`: rows [rank*B, (rank+1)*B) of the global batch.
  std::vector<int64_t> rank_offsets(int64_t step) const;

 private:
  std::vector<int64_t> offsets(int64_t step, int64_t first_row, int64_t rows) const;

  SamplerOptions options_;
  int64_t num_sequences_ = 0;
  int64_t epoch_ = 0;
  std::vector<int64_t> order_;  // sequence indices of this epoch; empty when not shuffling
};

// Inputs and targets of one batch: CPU int64 tensors of shape [B, T].
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

// Row i: inputs tokens[offsets[i], +T), targets tokens[offsets[i]+1, +T). Throws
// dtrain::InvalidArgument when a sequence runs past the end of `tokens`.
Batch make_batch(const TokenView& tokens, const std::vector<int64_t>& offsets, int64_t seq_len);

// This rank's batch of `step` in the sampler's current epoch.
Batch load_batch(const TokenView& tokens, const DistributedSampler& sampler, int64_t step);

}  // namespace gpt2

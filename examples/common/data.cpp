#include "data.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>

#include <ATen/ATen.h>

#include <dtrain/errors.h>

#include "split_mix64.h"

namespace gpt2 {
namespace fs = std::filesystem;

namespace {

uint64_t fnv1a(std::string_view bytes, uint64_t hash = 0xcbf29ce484222325ull) {
  for (const char c : bytes) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw dtrain::Error("cannot open " + path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return std::move(buffer).str();
}

// The files a source stands for, in the order they are tokenized.
std::vector<fs::path> source_files(const fs::path& source) {
  std::error_code ec;
  if (fs::is_regular_file(source, ec)) return {source};
  if (!fs::exists(source, ec)) {
    throw dtrain::Error("data source " + source.string() +
                        " does not exist (scripts/fetch-data.sh fetches the default corpus, "
                        "data/sotu.txt, and GPT-2's vocabulary)");
  }
  if (!fs::is_directory(source, ec)) {
    throw dtrain::Error("data source " + source.string() + " is neither a file nor a folder");
  }
  std::vector<fs::path> files;
  for (const fs::directory_entry& entry : fs::directory_iterator(source)) {
    if (entry.is_regular_file() && entry.path().extension() == ".txt")
      files.push_back(entry.path());
  }
  // Byte-wise on the file name, independent of the locale and of directory order.
  std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
    return a.filename().string() < b.filename().string();
  });
  if (files.empty()) throw dtrain::Error("data folder " + source.string() + " has no *.txt files");
  return files;
}

// `source` is absolute and normalized, so "data/x" and "./data/x" share a cache.
uint64_t cache_key(const fs::path& source, const std::vector<fs::path>& files,
                   const Tokenizer& tokenizer) {
  std::string key = "dtrain-tokens|" + source.string() + "|" + tokenizer.name() + "|" +
                    std::to_string(tokenizer.vocab_size());
  for (const fs::path& file : files) {
    key += "|" + file.filename().string() + "|" + std::to_string(fs::file_size(file)) + "|" +
           std::to_string(fs::last_write_time(file).time_since_epoch().count());
  }
  return fnv1a(key);
}

void check_vocab_fits(const Tokenizer& tokenizer) {
  if (tokenizer.vocab_size() > 65536) {
    throw dtrain::InvalidArgument("tokenizer " + tokenizer.name() + " has " +
                                  std::to_string(tokenizer.vocab_size()) +
                                  " ids, more than uint16 tokens can hold");
  }
}

std::string errno_text() { return std::strerror(errno); }

// Writes `bytes` to `path` through a unique temporary name and an atomic rename: a reader
// never sees a partial file. Throws dtrain::Error naming the file and the cause.
void write_file_atomically(const fs::path& path, const std::string& bytes) {
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid()) + "." +
                       std::to_string(std::random_device{}());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw dtrain::Error("cannot create " + tmp.string() + ": " + errno_text());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? errno_text() : "no progress";
      ::close(fd);
      ::unlink(tmp.c_str());
      throw dtrain::Error("cannot write " + tmp.string() + ": " + why);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw dtrain::Error("cannot write " + tmp.string() + ": " + why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw dtrain::Error("cannot rename " + tmp.string() + " to " + path.string() + ": " + why);
  }
}

void default_warn(const std::string& message) {
  std::fprintf(stderr, "warning: %s\n", message.c_str());
  std::fflush(stderr);
}

std::vector<int64_t> sequence_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  SplitMix64 rng(SplitMix64::stream_seed(seed, static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(order[i], order[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  return order;
}

}  // namespace

TokenView::TokenView(std::vector<uint16_t> tokens)
    : storage_(std::make_shared<const std::vector<uint16_t>>(std::move(tokens))),
      size_(static_cast<int64_t>(storage_->size())) {}

TokenView TokenView::slice(int64_t begin, int64_t size) const {
  if (begin < 0 || size < 0 || begin + size > size_) {
    throw dtrain::InvalidArgument("TokenView::slice(" + std::to_string(begin) + ", " +
                                  std::to_string(size) + ") of " + std::to_string(size_) +
                                  " tokens");
  }
  TokenView view = *this;
  view.begin_ = begin_ + begin;
  view.size_ = size;
  return view;
}

std::vector<uint16_t> tokenize_source(const fs::path& source, const Tokenizer& tokenizer) {
  check_vocab_fits(tokenizer);
  const std::vector<fs::path> files = source_files(source);
  // Between files: the end-of-text id, or the marker's own tokens when there is none, so a
  // folder and the file made by joining it with the marker tokenize alike.
  const std::vector<int32_t> separator =
      tokenizer.eot() >= 0 ? std::vector<int32_t>{tokenizer.eot()} : tokenizer.encode(kEndOfText);
  std::vector<uint16_t> tokens;
  for (size_t i = 0; i < files.size(); ++i) {
    if (i > 0) tokens.insert(tokens.end(), separator.begin(), separator.end());
    const std::vector<int32_t> ids = encode_documents(tokenizer, read_file(files[i]));
    tokens.insert(tokens.end(), ids.begin(), ids.end());
  }
  return tokens;
}

LoadedTokens load_tokens(const fs::path& source, const Tokenizer& tokenizer,
                         const TokenCacheOptions& options) {
  check_vocab_fits(tokenizer);
  const auto warn = options.warn ? options.warn : default_warn;
  fs::path name = fs::absolute(source).lexically_normal();
  // "data/sotu/" is the folder "data/sotu", whose cache is data/sotu.gpt2.tokens.
  if (!name.has_filename()) name = name.parent_path();
  const std::vector<fs::path> files = source_files(name);
  const uint64_t key = cache_key(name, files, tokenizer);
  const fs::path dir = options.cache_dir.empty() ? name.parent_path() : options.cache_dir;
  LoadedTokens loaded;
  loaded.cache_path = dir / (name.filename().string() + "." + tokenizer.name() + ".tokens");

  std::error_code ec;
  if (!options.force && fs::exists(loaded.cache_path, ec)) {
    try {
      loaded.tokens = TokenView(read_token_cache(loaded.cache_path, key, tokenizer.vocab_size()));
      loaded.from_cache = true;
      return loaded;
    } catch (const TokenCacheError& e) {
      // Stale caches are expected (the source changed); a corrupt one is worth a word.
      if (e.kind() == TokenCacheError::Kind::kCorrupt) {
        warn(e.cause() + "; tokenizing " + name.string() + " again");
      }
    }
  }
  std::vector<uint16_t> tokens = tokenize_source(name, tokenizer);
  // The tokens are in memory: a cache that cannot be stored costs time next run, not this one.
  try {
    if (!options.cache_dir.empty()) fs::create_directories(options.cache_dir);
    write_file_atomically(loaded.cache_path,
                          encode_token_cache(tokens, key, tokenizer.vocab_size()));
    loaded.cache_written = true;
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const dtrain::Error*>(&e);
    warn("cannot store token cache " + loaded.cache_path.string() + " (" +
         (error != nullptr ? error->cause() : std::string(e.what())) + "); continuing with the " +
         std::to_string(tokens.size()) + " tokens in memory");
  }
  loaded.tokens = TokenView(std::move(tokens));
  return loaded;
}

TokenView make_random_tokens(int64_t num_tokens, int64_t vocab_size, uint64_t seed) {
  if (num_tokens < 0 || vocab_size < 1 || vocab_size > 65536) {
    throw dtrain::InvalidArgument(
        "make_random_tokens: need num_tokens >= 0 and vocab_size in "
        "[1, 65536], got " +
        std::to_string(num_tokens) + " and " + std::to_string(vocab_size));
  }
  SplitMix64 rng(seed);
  std::vector<uint16_t> tokens(num_tokens);
  for (uint16_t& t : tokens) t = static_cast<uint16_t>(rng.below(vocab_size));
  return TokenView(std::move(tokens));
}

TrainValSplit split_train_val(const TokenView& tokens, double val_fraction) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0)) {
    throw dtrain::InvalidArgument("split_train_val: val_fraction must be in [0, 1), got " +
                                  std::to_string(val_fraction));
  }
  const auto val = static_cast<int64_t>(static_cast<double>(tokens.size()) * val_fraction);
  return {tokens.slice(0, tokens.size() - val), tokens.slice(tokens.size() - val, val)};
}

DistributedSampler::DistributedSampler(int64_t num_tokens, const SamplerOptions& options)
    : options_(options) {
  const auto fail = [&](const std::string& why) {
    throw dtrain::InvalidArgument(
        dtrain::ErrorContext{options.rank, options.world_size, "DistributedSampler()", -1}, why);
  };
  if (options.seq_len < 1 || options.batch_size < 1) fail("seq_len and batch_size must be >= 1");
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    fail("rank must be in [0, world_size)");
  }
  if (num_tokens < 0) fail("num_tokens must be >= 0");
  // Sequence k reads tokens [k*T, k*T + T + 1): the last one needs one token past its inputs.
  num_sequences_ = num_tokens > 0 ? (num_tokens - 1) / options.seq_len : 0;
  if (steps_per_epoch() < 1) {
    fail(std::to_string(num_tokens) + " tokens hold " + std::to_string(num_sequences_) +
         " sequences of " + std::to_string(options.seq_len) +
         "+1 tokens, fewer than one global batch of " + std::to_string(global_batch_size()));
  }
  set_epoch(0);
}

void DistributedSampler::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  if (options_.shuffle) order_ = sequence_order(num_sequences_, options_.seed, epoch);
}

std::vector<int64_t> DistributedSampler::offsets(int64_t step, int64_t first_row,
                                                 int64_t rows) const {
  if (step < 0 || step >= steps_per_epoch()) {
    throw dtrain::InvalidArgument(
        dtrain::ErrorContext{options_.rank, options_.world_size, "DistributedSampler", -1},
        "step " + std::to_string(step) + " is outside [0, " + std::to_string(steps_per_epoch()) +
            ")");
  }
  std::vector<int64_t> result(rows);
  const int64_t first = step * global_batch_size() + first_row;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t sequence = options_.shuffle ? order_[first + i] : first + i;
    result[i] = sequence * options_.seq_len;
  }
  return result;
}

std::vector<int64_t> DistributedSampler::global_offsets(int64_t step) const {
  return offsets(step, 0, global_batch_size());
}

std::vector<int64_t> DistributedSampler::rank_offsets(int64_t step) const {
  return offsets(step, options_.rank * options_.batch_size, options_.batch_size);
}

Batch make_batch(const TokenView& tokens, const std::vector<int64_t>& offsets, int64_t seq_len) {
  const auto rows = static_cast<int64_t>(offsets.size());
  Batch batch{at::empty({rows, seq_len}, at::kLong), at::empty({rows, seq_len}, at::kLong)};
  int64_t* inputs = batch.inputs.data_ptr<int64_t>();
  int64_t* targets = batch.targets.data_ptr<int64_t>();
  const uint16_t* data = tokens.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = offsets[r];
    if (o < 0 || o + seq_len + 1 > tokens.size()) {
      throw dtrain::InvalidArgument("make_batch: sequence at " + std::to_string(o) + " of " +
                                    std::to_string(seq_len) + "+1 tokens runs past " +
                                    std::to_string(tokens.size()) + " tokens");
    }
    for (int64_t t = 0; t < seq_len; ++t) {
      inputs[r * seq_len + t] = data[o + t];
      targets[r * seq_len + t] = data[o + t + 1];
    }
  }
  return batch;
}

Batch load_batch(const TokenView& tokens, const DistributedSampler& sampler, int64_t step) {
  return make_batch(tokens, sampler.rank_offsets(step), sampler.options().seq_len);
}

}  // namespace gpt2

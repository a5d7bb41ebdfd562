// Tests of the token cache, the train/validation split and the distributed sampler.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <dtrain/errors.h>

#include "data.h"

namespace gpt2 {
namespace {

namespace fs = std::filesystem;

fs::path data_dir() {
  const char* env = std::getenv("DTRAIN_DATA_DIR");
  return env != nullptr && *env != '\0' ? fs::path(env) : fs::path(GPT2_DEFAULT_DATA_DIR);
}

// A fresh folder per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / ("gpt2_data_test_" + std::to_string(::getpid()) + "_" +
                                         info->test_suite_name() + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

std::vector<uint16_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }

// ---- Token cache --------------------------------------------------------------------

TEST(TokenCache, WrittenOnceAndReused) {
  TempDir dir;
  const fs::path source = dir.path() / "corpus.txt";
  write_text(source, "hello world");
  const ByteTokenizer tok;

  const LoadedTokens first = load_tokens(source, tok);
  EXPECT_FALSE(first.from_cache);
  EXPECT_EQ(first.cache_path, dir.path() / "corpus.txt.byte.tokens");
  EXPECT_EQ(first.tokens.to_vector(), bytes_of("hello world"));
  // 32-byte header, then two bytes per token.
  EXPECT_EQ(fs::file_size(first.cache_path), 32u + 2u * 11u);
  const auto written_at = fs::last_write_time(first.cache_path);

  const LoadedTokens second = load_tokens(source, tok);
  EXPECT_TRUE(second.from_cache);
  EXPECT_EQ(second.tokens.to_vector(), first.tokens.to_vector());
  EXPECT_EQ(fs::last_write_time(first.cache_path), written_at);

  TokenCacheOptions force;
  force.force = true;
  EXPECT_FALSE(load_tokens(source, tok, force).from_cache);
  EXPECT_TRUE(load_tokens(source, tok).from_cache);
}

TEST(TokenCache, RetokenizesWhenTheSourceChanges) {
  TempDir dir;
  const fs::path source = dir.path() / "corpus.txt";
  write_text(source, "abc");
  const ByteTokenizer tok;
  ASSERT_FALSE(load_tokens(source, tok).from_cache);

  // A different size.
  write_text(source, "abcd");
  LoadedTokens loaded = load_tokens(source, tok);
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("abcd"));
  EXPECT_TRUE(load_tokens(source, tok).from_cache);

  // The same size, a later modification time (set explicitly: a coarse file system clock
  // could give the rewrite the old time).
  const auto before = fs::last_write_time(source);
  write_text(source, "wxyz");
  fs::last_write_time(source, before + std::chrono::seconds(2));
  loaded = load_tokens(source, tok);
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("wxyz"));
}

TEST(TokenCache, RejectsACorruptOrForeignCache) {
  TempDir dir;
  const fs::path source = dir.path() / "corpus.txt";
  write_text(source, "some text");
  const ByteTokenizer tok;
  const LoadedTokens loaded = load_tokens(source, tok);
  fs::resize_file(loaded.cache_path, fs::file_size(loaded.cache_path) - 2);
  EXPECT_FALSE(load_tokens(source, tok).from_cache);
  EXPECT_TRUE(load_tokens(source, tok).from_cache);
  write_text(loaded.cache_path, "not a token file at all, but long enough for a header");
  const LoadedTokens again = load_tokens(source, tok);
  EXPECT_FALSE(again.from_cache);
  EXPECT_EQ(again.tokens.to_vector(), bytes_of("some text"));
}

TEST(TokenCache, CacheDirOption) {
  TempDir dir;
  const fs::path source = dir.path() / "corpus.txt";
  write_text(source, "text");
  TokenCacheOptions options;
  options.cache_dir = dir.path() / "cache" / "nested";
  const LoadedTokens loaded = load_tokens(source, ByteTokenizer(), options);
  EXPECT_EQ(loaded.cache_path, options.cache_dir / "corpus.txt.byte.tokens");
  EXPECT_TRUE(fs::exists(loaded.cache_path));
  EXPECT_TRUE(load_tokens(source, ByteTokenizer(), options).from_cache);
}

TEST(TokenCache, FolderIsSortedTxtFilesJoinedByTheMarker) {
  TempDir dir;
  const fs::path folder = dir.path() / "docs";
  fs::create_directories(folder / "sub");
  write_text(folder / "b.txt", "second");
  write_text(folder / "a.txt", "first");
  write_text(folder / "c.md", "ignored: not .txt");
  write_text(folder / "sub" / "d.txt", "ignored: not recursive");
  const ByteTokenizer tok;

  const LoadedTokens loaded = load_tokens(folder, tok);
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_EQ(loaded.cache_path, dir.path() / "docs.byte.tokens");
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("first<|endoftext|>second"));
  // A trailing separator names the same folder and the same cache.
  EXPECT_TRUE(load_tokens(folder / "", tok).from_cache);

  // A new file changes the key.
  write_text(folder / "c.txt", "third");
  const LoadedTokens more = load_tokens(folder, tok);
  EXPECT_FALSE(more.from_cache);
  EXPECT_EQ(more.tokens.to_vector(), bytes_of("first<|endoftext|>second<|endoftext|>third"));

  EXPECT_THROW(load_tokens(dir.path() / "missing.txt", tok), dtrain::Error);
  fs::create_directories(dir.path() / "empty");
  EXPECT_THROW(load_tokens(dir.path() / "empty", tok), dtrain::Error);
}

TEST(TokenCache, Gpt2FolderAndJoinedFileGiveTheSameTokens) {
  const fs::path vocab = data_dir() / "gpt2";
  if (!fs::exists(vocab / "encoder.json")) {
    GTEST_SKIP() << "GPT-2 vocabulary not found in " << vocab << "; run scripts/fetch-data.sh";
  }
  const std::unique_ptr<Gpt2Tokenizer> tok = Gpt2Tokenizer::from_dir(vocab);
  TempDir dir;
  fs::create_directories(dir.path() / "docs");
  write_text(dir.path() / "docs" / "1.txt", "Fellow citizens,\n");
  write_text(dir.path() / "docs" / "2.txt", " the state of the union");
  write_text(dir.path() / "joined.txt", "Fellow citizens,\n<|endoftext|> the state of the union");

  const std::vector<uint16_t> from_folder =
      load_tokens(dir.path() / "docs", *tok).tokens.to_vector();
  const std::vector<uint16_t> from_file =
      load_tokens(dir.path() / "joined.txt", *tok).tokens.to_vector();
  EXPECT_EQ(from_folder, from_file);
  ASSERT_EQ(std::count(from_file.begin(), from_file.end(), 50256), 1);
  const std::vector<int32_t> ids(from_file.begin(), from_file.end());
  EXPECT_EQ(tok->decode(ids), "Fellow citizens,\n<|endoftext|> the state of the union");
}

// Tokenizes the real corpus through the cache, as the trainer will (skipped without data).
TEST(TokenCache, SotuCorpus) {
  const fs::path vocab = data_dir() / "gpt2";
  const fs::path corpus = data_dir() / "sotu.txt";
  if (!fs::exists(vocab / "encoder.json") || !fs::exists(corpus)) {
    GTEST_SKIP() << "GPT-2 vocabulary or SOTU corpus not found in " << data_dir()
                 << "; run scripts/fetch-data.sh";
  }
  const std::unique_ptr<Gpt2Tokenizer> tok = Gpt2Tokenizer::from_dir(vocab);
  TempDir dir;
  TokenCacheOptions options;
  options.cache_dir = dir.path();
  const auto start = std::chrono::steady_clock::now();
  const LoadedTokens loaded = load_tokens(corpus, *tok, options);
  const auto middle = std::chrono::steady_clock::now();
  const LoadedTokens cached = load_tokens(corpus, *tok, options);
  const auto end = std::chrono::steady_clock::now();
  std::printf("[          ] SOTU: %lld tokens; tokenized in %.2f s, loaded from cache in %.3f s\n",
              static_cast<long long>(loaded.tokens.size()),
              std::chrono::duration<double>(middle - start).count(),
              std::chrono::duration<double>(end - middle).count());
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_TRUE(cached.from_cache);
  EXPECT_EQ(loaded.tokens.size(), 2074511);
  EXPECT_EQ(cached.tokens.to_vector(), loaded.tokens.to_vector());
}

TEST(RandomTokens, DeterministicAndInRange) {
  const TokenView a = make_random_tokens(10000, 50257, 7);
  const TokenView b = make_random_tokens(10000, 50257, 7);
  const TokenView c = make_random_tokens(10000, 50257, 8);
  EXPECT_EQ(a.size(), 10000);
  EXPECT_EQ(a.to_vector(), b.to_vector());
  EXPECT_NE(a.to_vector(), c.to_vector());
  for (int64_t i = 0; i < a.size(); ++i) ASSERT_LT(a[i], 50257);
  const TokenView small = make_random_tokens(2000, 16, 1);
  const std::vector<uint16_t> values = small.to_vector();
  EXPECT_EQ(std::set<uint16_t>(values.begin(), values.end()).size(), 16u);
  EXPECT_EQ(*std::max_element(values.begin(), values.end()), 15);
  EXPECT_THROW(make_random_tokens(10, 70000, 0), dtrain::InvalidArgument);
}

// ---- Split --------------------------------------------------------------------------

TokenView iota_tokens(int64_t n) {
  std::vector<uint16_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<uint16_t>(i % 65536);
  return TokenView(std::move(tokens));
}

TEST(Split, LastFractionIsValidation) {
  const TokenView tokens = iota_tokens(1000);
  const TrainValSplit split = split_train_val(tokens);
  EXPECT_EQ(split.train.size(), 950);
  EXPECT_EQ(split.val.size(), 50);
  EXPECT_EQ(split.train[0], 0);
  EXPECT_EQ(split.train[949], 949);
  EXPECT_EQ(split.val[0], 950);
  EXPECT_EQ(split.val[49], 999);

  EXPECT_EQ(split_train_val(iota_tokens(1019), 0.05).val.size(), 50);  // floor(50.95)
  EXPECT_EQ(split_train_val(tokens, 0.1).val.size(), 100);
  const TrainValSplit none = split_train_val(tokens, 0.0);
  EXPECT_EQ(none.train.size(), 1000);
  EXPECT_EQ(none.val.size(), 0);
  EXPECT_THROW(split_train_val(tokens, 1.0), dtrain::InvalidArgument);
  EXPECT_THROW(split_train_val(tokens, -0.1), dtrain::InvalidArgument);
}

TEST(Split, SlicesShareStorage) {
  const TokenView tokens = iota_tokens(100);
  const TokenView middle = tokens.slice(10, 20).slice(5, 5);
  EXPECT_EQ(middle.size(), 5);
  EXPECT_EQ(middle[0], 15);
  EXPECT_EQ(middle.data(), tokens.data() + 15);
  EXPECT_THROW(tokens.slice(90, 11), dtrain::InvalidArgument);
}

// ---- Sampler ------------------------------------------------------------------------

SamplerOptions sampler_options(int64_t seq_len, int64_t batch, int rank, int world,
                               uint64_t seed = 1234) {
  SamplerOptions o;
  o.seq_len = seq_len;
  o.batch_size = batch;
  o.rank = rank;
  o.world_size = world;
  o.seed = seed;
  return o;
}

TEST(Sampler, RanksAreDisjointAndCoverTheGlobalBatch) {
  const int64_t seq_len = 8;
  const int64_t batch = 3;
  const int64_t num_tokens = 101 * seq_len + 1;  // exactly 101 sequences
  for (int world = 1; world <= 4; ++world) {
    for (int64_t epoch : {0, 1, 5}) {
      std::vector<DistributedSampler> ranks;
      for (int r = 0; r < world; ++r) {
        ranks.emplace_back(num_tokens, sampler_options(seq_len, batch, r, world));
        ranks.back().set_epoch(epoch);
      }
      const DistributedSampler& first = ranks.front();
      ASSERT_EQ(first.num_sequences(), 101);
      ASSERT_EQ(first.steps_per_epoch(), 101 / (batch * world));  // the remainder is dropped
      std::set<int64_t> seen;
      for (int64_t step = 0; step < first.steps_per_epoch(); ++step) {
        std::vector<int64_t> concatenated;
        for (const DistributedSampler& s : ranks) {
          const std::vector<int64_t> mine = s.rank_offsets(step);
          ASSERT_EQ(static_cast<int64_t>(mine.size()), batch);
          concatenated.insert(concatenated.end(), mine.begin(), mine.end());
        }
        // Rank r's rows are rows [r*B, (r+1)*B) of the global batch, which every rank
        // computes alike.
        EXPECT_EQ(concatenated, first.global_offsets(step)) << "world " << world;
        for (const DistributedSampler& s : ranks) EXPECT_EQ(s.global_offsets(step), concatenated);
        for (const int64_t o : concatenated) {
          EXPECT_EQ(o % seq_len, 0);
          EXPECT_LE(o + seq_len + 1, num_tokens);
          EXPECT_TRUE(seen.insert(o).second) << "offset " << o << " drawn twice in an epoch";
        }
      }
      EXPECT_EQ(static_cast<int64_t>(seen.size()), first.steps_per_epoch() * batch * world);
    }
  }
}

TEST(Sampler, WorldOfNEqualsOneRankWithTheGlobalBatch) {
  const int64_t num_tokens = 10000;
  for (int world = 2; world <= 4; ++world) {
    DistributedSampler single(num_tokens, sampler_options(16, 2 * world, 0, 1));
    single.set_epoch(3);
    std::vector<int64_t> concatenated;
    for (int r = 0; r < world; ++r) {
      DistributedSampler s(num_tokens, sampler_options(16, 2, r, world));
      s.set_epoch(3);
      ASSERT_EQ(s.steps_per_epoch(), single.steps_per_epoch());
      const std::vector<int64_t> mine = s.rank_offsets(4);
      concatenated.insert(concatenated.end(), mine.begin(), mine.end());
    }
    EXPECT_EQ(concatenated, single.rank_offsets(4));
  }
}

TEST(Sampler, DeterministicPerSeedAndEpoch) {
  DistributedSampler a(5000, sampler_options(10, 4, 1, 2, 42));
  DistributedSampler b(5000, sampler_options(10, 4, 1, 2, 42));
  DistributedSampler other_seed(5000, sampler_options(10, 4, 1, 2, 43));
  EXPECT_EQ(a.rank_offsets(3), b.rank_offsets(3));
  EXPECT_NE(a.global_offsets(0), other_seed.global_offsets(0));

  const std::vector<int64_t> epoch0 = a.global_offsets(0);
  a.set_epoch(1);
  EXPECT_EQ(a.epoch(), 1);
  EXPECT_NE(a.global_offsets(0), epoch0);
  b.set_epoch(1);
  EXPECT_EQ(a.global_offsets(0), b.global_offsets(0));
  a.set_epoch(0);
  EXPECT_EQ(a.global_offsets(0), epoch0);

  // An epoch is a permutation: sorted, the whole epoch is every sequence used once.
  std::vector<int64_t> all;
  for (int64_t step = 0; step < a.steps_per_epoch(); ++step) {
    const std::vector<int64_t> g = a.global_offsets(step);
    all.insert(all.end(), g.begin(), g.end());
  }
  EXPECT_FALSE(std::is_sorted(all.begin(), all.end()));
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
}

TEST(Sampler, WithoutShuffleReadsInOrder) {
  SamplerOptions o = sampler_options(4, 2, 1, 2);
  o.shuffle = false;
  DistributedSampler s(41, o);  // (41 - 1) / 4 = 10 sequences, 2 steps of 4
  EXPECT_EQ(s.num_sequences(), 10);
  EXPECT_EQ(s.steps_per_epoch(), 2);
  EXPECT_EQ(s.global_offsets(1), (std::vector<int64_t>{16, 20, 24, 28}));
  EXPECT_EQ(s.rank_offsets(1), (std::vector<int64_t>{24, 28}));
  s.set_epoch(7);
  EXPECT_EQ(s.rank_offsets(1), (std::vector<int64_t>{24, 28}));
}

TEST(Sampler, RejectsBadArguments) {
  EXPECT_THROW(DistributedSampler(1000, sampler_options(8, 2, 2, 2)), dtrain::InvalidArgument);
  EXPECT_THROW(DistributedSampler(1000, sampler_options(0, 2, 0, 1)), dtrain::InvalidArgument);
  // 4 * 8 + 1 tokens hold 4 sequences, fewer than a global batch of 6.
  EXPECT_THROW(DistributedSampler(33, sampler_options(8, 3, 0, 2)), dtrain::InvalidArgument);
  EXPECT_NO_THROW(DistributedSampler(33, sampler_options(8, 2, 0, 2)));
  const DistributedSampler s(33, sampler_options(8, 2, 0, 2));
  EXPECT_THROW(s.rank_offsets(1), dtrain::InvalidArgument);
  EXPECT_THROW(s.rank_offsets(-1), dtrain::InvalidArgument);
}

// ---- Batches ------------------------------------------------------------------------

TEST(Batch, TargetsAreInputsShiftedByOne) {
  const TokenView tokens = iota_tokens(200);
  const Batch batch = make_batch(tokens, {0, 40, 190}, 9);
  EXPECT_EQ(batch.inputs.sizes(), (std::vector<int64_t>{3, 9}));
  EXPECT_EQ(batch.targets.sizes(), (std::vector<int64_t>{3, 9}));
  EXPECT_EQ(batch.inputs.scalar_type(), at::kLong);
  EXPECT_EQ(batch.targets.scalar_type(), at::kLong);
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t o = std::vector<int64_t>{0, 40, 190}[r];
    for (int64_t t = 0; t < 9; ++t) {
      EXPECT_EQ(batch.inputs[r][t].item<int64_t>(), o + t);
      EXPECT_EQ(batch.targets[r][t].item<int64_t>(), o + t + 1);
    }
  }
  EXPECT_THROW(make_batch(tokens, {191}, 9), dtrain::InvalidArgument);
}

TEST(Batch, LoadBatchReadsThisRanksRows) {
  const TokenView tokens = iota_tokens(1001);
  const int world = 3;
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(tokens.size(), sampler_options(10, 2, r, world));
    s.set_epoch(2);
    const Batch b = load_batch(tokens, s, 5);
    EXPECT_TRUE(at::equal(b.targets.slice(1, 0, 9), b.inputs.slice(1, 1, 10)));
    inputs.push_back(b.inputs);
  }
  DistributedSampler single(tokens.size(), sampler_options(10, 2 * world, 0, 1));
  single.set_epoch(2);
  EXPECT_TRUE(at::equal(at::cat(inputs, 0), load_batch(tokens, single, 5).inputs));
}

}  // namespace
}  // namespace gpt2

// Tests of the token cache, the train/validation split and the distributed sampler.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <dtrain/errors.h>

#include "data.h"
#include "dtrain/crc32c.h"

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
  // 40-byte header, then two bytes per token.
  EXPECT_EQ(fs::file_size(first.cache_path), 40u + 2u * 11u);
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

// ---- Bad caches, bad folders, missing data -----------------------------------------

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

void put_le(std::string& bytes, size_t offset, uint64_t value, int width) {
  for (int i = 0; i < width; ++i) bytes[offset + i] = static_cast<char>(value >> (8 * i));
}

// Recomputes both checksums, so that only the check a test aims at can fail.
void reseal(std::string& bytes) {
  const size_t payload = bytes.size() - kTokenCacheHeaderBytes;
  put_le(bytes, 32, dtrain::crc32c(0, bytes.data() + kTokenCacheHeaderBytes, payload), 4);
  put_le(bytes, 36, dtrain::crc32c(0, bytes.data(), 36), 4);
}

// A source whose cache load_tokens() wrote; warnings are collected.
struct CachedSource {
  TempDir dir;
  fs::path source = dir.path() / "corpus.txt";
  fs::path cache;
  std::vector<std::string> warnings;
  TokenCacheOptions options;

  explicit CachedSource(const std::string& text) {
    write_text(source, text);
    options.warn = [this](const std::string& w) { warnings.push_back(w); };
    const LoadedTokens loaded = load_tokens(source, ByteTokenizer(), options);
    EXPECT_TRUE(loaded.cache_written);
    cache = loaded.cache_path;
  }
  LoadedTokens load() { return load_tokens(source, ByteTokenizer(), options); }
  bool warned(const std::string& part) const {
    for (const std::string& w : warnings) {
      if (w.find(cache.string()) != std::string::npos && w.find(part) != std::string::npos) {
        return true;
      }
    }
    return false;
  }
};

TEST(TokenCache, FileFormat) {
  const std::string bytes = encode_token_cache({1, 2, 255}, 0x1234, 256);
  ASSERT_EQ(bytes.size(), kTokenCacheHeaderBytes + 6);
  EXPECT_EQ(bytes.substr(0, 8), std::string("DTRNTOK\0", 8));
  EXPECT_EQ(static_cast<unsigned char>(bytes[8]), kTokenCacheVersion);
  EXPECT_EQ(decode_token_cache(bytes, 0x1234, 256, "x"), (std::vector<uint16_t>{1, 2, 255}));
  EXPECT_EQ(decode_token_cache(encode_token_cache({}, 7, 1), 7, 1, "x"), std::vector<uint16_t>{});
  EXPECT_THROW(encode_token_cache({256}, 0, 256), dtrain::InvalidArgument);
  EXPECT_THROW(encode_token_cache({0}, 0, 65537), dtrain::InvalidArgument);
}

// Decoding `bytes` fails with a TokenCacheError of `kind` naming the cache and `problem`.
void expect_refused(const std::string& bytes, TokenCacheError::Kind kind,
                    const std::string& problem, uint64_t key = 0x1234, int64_t vocab = 256) {
  try {
    decode_token_cache(bytes, key, vocab, "/some/corpus.txt.byte.tokens");
    ADD_FAILURE() << "accepted; expected: " << problem;
  } catch (const TokenCacheError& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find("token cache /some/corpus.txt.byte.tokens: "),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(problem), std::string::npos) << e.what();
  }
}

TEST(TokenCache, DecodeRefusesEveryMalformedFile) {
  using Kind = TokenCacheError::Kind;
  const std::string good = encode_token_cache({10, 20, 30, 40}, 0x1234, 256);
  expect_refused(good.substr(0, 39), Kind::kCorrupt, "shorter than its 40-byte header");
  expect_refused(good.substr(0, good.size() - 2), Kind::kCorrupt,
                 "the header says 4 tokens, but 6 bytes follow it");
  expect_refused(good + "x", Kind::kCorrupt, "the header says 4 tokens, but 9 bytes follow it");
  std::string bad = good;
  bad[0] = 'X';
  expect_refused(bad, Kind::kCorrupt, "not a token cache (bad magic)");
  bad = good;
  put_le(bad, 8, 1, 4);
  expect_refused(bad, Kind::kStale, "format version 1, this build reads 2");
  bad = good;
  bad[20] ^= 1;  // a bit of the token count, checksum not updated
  expect_refused(bad, Kind::kCorrupt, "header checksum mismatch");
  bad = good;
  bad[kTokenCacheHeaderBytes] ^= 1;  // a token bit
  expect_refused(bad, Kind::kCorrupt, "token checksum mismatch");
  expect_refused(good, Kind::kStale, "written for another source or tokenizer", 0x9999);
  expect_refused(good, Kind::kStale, "written for a vocabulary of 256 ids, the tokenizer has 300",
                 0x1234, 300);

  // A valid checksum over an id the vocabulary does not have.
  bad = good;
  put_le(bad, kTokenCacheHeaderBytes + 2, 300, 2);
  reseal(bad);
  expect_refused(bad, Kind::kCorrupt, "token 1 is id 300, outside the vocabulary [0, 256)");

  // A count that, doubled, wraps to the real size (2^63 + 4 tokens "fit" in 8 bytes).
  bad = good;
  put_le(bad, 16, (uint64_t{1} << 63) + 4, 8);
  reseal(bad);
  expect_refused(bad, Kind::kCorrupt,
                 "the header says 9223372036854775812 tokens, but 8 bytes follow it");
}

// The data pipeline never trains on a damaged cache: it rebuilds it and says why.
TEST(TokenCache, ChangedTokenIsRebuiltByChecksum) {
  CachedSource s("hello world");
  std::string bytes = read_bytes(s.cache);
  bytes[bytes.size() - 2] = 'D';  // "hello worlD", checksum not updated
  write_bytes(s.cache, bytes);
  const LoadedTokens loaded = s.load();
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("hello world"));
  EXPECT_TRUE(s.warned("token checksum mismatch; tokenizing "))
      << ::testing::PrintToString(s.warnings);
  EXPECT_TRUE(s.load().from_cache);  // rewritten
}

TEST(TokenCache, OutOfRangeIdIsRebuiltNamingTheCache) {
  CachedSource s("hello world");
  std::string bytes = read_bytes(s.cache);
  put_le(bytes, bytes.size() - 2, 0xffff, 2);
  reseal(bytes);
  write_bytes(s.cache, bytes);
  const LoadedTokens loaded = s.load();
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("hello world"));
  EXPECT_TRUE(s.warned("is id 65535, outside the vocabulary [0, 256)"))
      << ::testing::PrintToString(s.warnings);
  // Read directly, the same cache is refused with a message naming it.
  write_bytes(s.cache, bytes);
  uint64_t key = 0;
  for (int i = 7; i >= 0; --i) key = key << 8 | static_cast<unsigned char>(bytes[24 + i]);
  try {
    read_token_cache(s.cache, key, 256);
    ADD_FAILURE() << "an out-of-range id was accepted";
  } catch (const TokenCacheError& e) {
    EXPECT_EQ(e.cause(), "token cache " + s.cache.string() +
                             ": token 10 is id 65535, outside the vocabulary [0, 256)");
  }
}

TEST(TokenCache, HugeTokenCountIsRefusedWithoutWrapping) {
  CachedSource s("0123456789");
  std::string bytes = read_bytes(s.cache);
  put_le(bytes, 16, (uint64_t{1} << 63) + 10, 8);  // 2 * count wraps to the real 20 bytes
  reseal(bytes);
  write_bytes(s.cache, bytes);
  const LoadedTokens loaded = s.load();
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("0123456789"));
  EXPECT_TRUE(s.warned("the header says 9223372036854775818 tokens, but 20 bytes follow it"))
      << ::testing::PrintToString(s.warnings);
}

TEST(TokenCache, OldFormatIsRebuiltSilently) {
  CachedSource s("abc");
  std::string bytes = read_bytes(s.cache);
  put_le(bytes, 8, 1, 4);
  reseal(bytes);
  write_bytes(s.cache, bytes);
  EXPECT_FALSE(s.load().from_cache);
  EXPECT_TRUE(s.warnings.empty()) << ::testing::PrintToString(s.warnings);
  EXPECT_TRUE(s.load().from_cache);
}

// A cache that cannot be written costs the next run time, never this run: the tokens are
// in memory. (Root ignores permissions, so the unwritable places are made unwritable for
// everyone: a folder where the cache file should go, a cache folder below a regular file.)
TEST(TokenCache, UnwritableCacheWarnsAndContinues) {
  TempDir dir;
  const fs::path source = dir.path() / "corpus.txt";
  write_text(source, "in memory");
  std::vector<std::string> warnings;
  TokenCacheOptions options;
  options.warn = [&](const std::string& w) { warnings.push_back(w); };

  const fs::path cache = dir.path() / "corpus.txt.byte.tokens";
  fs::create_directories(cache / "occupied");
  LoadedTokens loaded = load_tokens(source, ByteTokenizer(), options);
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("in memory"));
  EXPECT_FALSE(loaded.from_cache);
  EXPECT_FALSE(loaded.cache_written);
  // First the folder in the cache's place is named as unusable, then as unwritable.
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_EQ(warnings[0], "token cache " + cache.string() + ": not a regular file; tokenizing " +
                             source.string() + " again");
  EXPECT_NE(warnings[1].find("cannot store token cache " + cache.string()), std::string::npos)
      << warnings[1];
  EXPECT_NE(warnings[1].find("continuing with the 9 tokens in memory"), std::string::npos)
      << warnings[1];
  int entries = 0;  // no temporary file left behind
  for (const auto& entry : fs::directory_iterator(dir.path())) entries += entry.exists() ? 1 : 0;
  EXPECT_EQ(entries, 2);
  fs::remove_all(cache);

  options.cache_dir = source / "cache";  // below a regular file
  warnings.clear();
  loaded = load_tokens(source, ByteTokenizer(), options);
  EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("in memory"));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("cannot store token cache"), std::string::npos) << warnings[0];

  if (::geteuid() != 0) {  // a read-only data folder, where permissions apply
    options.cache_dir.clear();
    warnings.clear();
    fs::permissions(dir.path(), fs::perms::owner_read | fs::perms::owner_exec);
    loaded = load_tokens(source, ByteTokenizer(), options);
    fs::permissions(dir.path(), fs::perms::owner_all);
    EXPECT_EQ(loaded.tokens.to_vector(), bytes_of("in memory"));
    EXPECT_EQ(warnings.size(), 1u);
  }
}

TEST(TokenCache, MissingSourceNamesTheFetchScript) {
  TempDir dir;
  try {
    load_tokens(dir.path() / "sotu.txt", ByteTokenizer());
    ADD_FAILURE() << "a missing source was accepted";
  } catch (const dtrain::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find((dir.path() / "sotu.txt").string() + " does not exist"), std::string::npos)
        << what;
    EXPECT_NE(what.find("scripts/fetch-data.sh"), std::string::npos) << what;
  }
}

#ifdef GPT2_TRAIN_BIN
// --data random trains without GPT-2's vocabulary files (the model gets GPT-2's 50257 ids).
TEST(RandomTokens, TrainerNeedsNoVocabulary) {
  TempDir dir;
  const std::string cmd =
      std::string("OMP_NUM_THREADS=1 DTRAIN_DATA_DIR=") + dir.path().string() + " " +
      GPT2_TRAIN_BIN + " --data random --vocab_dir " + (dir.path() / "no-vocab").string() +
      " --layers 1 --heads 2 --dim 32 --ctx 16 --batch 2 --steps 2 --max_tokens 2048"
      " --val_batches 1 --sample_tokens 8 --blas_kernel keep --log_every 1 >" +
      (dir.path() / "log").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream log(dir.path() / "log");
  const std::string output{std::istreambuf_iterator<char>(log), std::istreambuf_iterator<char>()};
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("2048 random tokens"), std::string::npos) << output;
}
#endif

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

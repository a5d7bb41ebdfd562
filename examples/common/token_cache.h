// The GPT-2 example's token cache file: the tokens of a corpus with what they were made
// for and two checksums, read back only after every check passes. Plain C++ (no LibTorch),
// so the fuzz target tests/fuzz/token_cache_fuzz.cpp can build it alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <dtrain/errors.h>

namespace gpt2 {

// Format version 2, all integers little-endian:
//   bytes  0..8   magic "DTRNTOK\0"
//          8..12  format version (2)
//         12..16  vocabulary size: every token is below it
//         16..24  token count N
//         24..32  key (see load_tokens() in data.h)
//         32..36  CRC-32C of the N * 2 token bytes
//         36..40  CRC-32C of bytes 0..36
//         40..    N uint16 tokens
// The file is exactly 40 + 2N bytes.

inline constexpr size_t kTokenCacheHeaderBytes = 40;
inline constexpr uint32_t kTokenCacheVersion = 2;

// Why a token cache cannot be used. kStale: valid, but written for another key, vocabulary
// or format version. kCorrupt: damaged or not a token cache. what() names the file.
class TokenCacheError : public dtrain::Error {
 public:
  enum class Kind { kStale, kCorrupt };
  TokenCacheError(Kind kind, const std::string& message) : dtrain::Error(message), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// The bytes of a cache file holding `tokens` for `key` and `vocab_size`. Throws
// dtrain::InvalidArgument when a token is not below vocab_size or vocab_size is not in
// [1, 65536].
std::string encode_token_cache(const std::vector<uint16_t>& tokens, uint64_t key,
                               int64_t vocab_size);

// The tokens of a cache file's `bytes` (named `name` in messages) after checking everything
// the format promises: its size, magic, version, header checksum, vocabulary size, key,
// token count (compared without overflow), token checksum and every id below vocab_size.
// Throws TokenCacheError "token cache <name>: <problem>".
std::vector<uint16_t> decode_token_cache(std::string_view bytes, uint64_t key, int64_t vocab_size,
                                         const std::string& name);

// The same for the file at `path`, read without a second in-memory copy. A missing file is
// a kStale TokenCacheError.
std::vector<uint16_t> read_token_cache(const std::filesystem::path& path, uint64_t key,
                                       int64_t vocab_size);

}  // namespace gpt2

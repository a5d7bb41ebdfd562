// The GPT-2 example's token cache reader on arbitrary bytes: it must either return tokens
// that are all below the vocabulary and encode back to exactly the input, or refuse it with
// a TokenCacheError. Any other exception, a crash or a sanitizer report is a bug.
//
// The first input byte selects how the rest is read, so that the search gets past the
// checksums to the checks behind them:
//   bit 0: recompute both CRC-32C fields before reading (else they are taken as they are);
//   bit 1: also read through a temporary file (read_token_cache), which must agree.
// The key and vocabulary size expected are the file's own, so only consistency is tested.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/crc32c.h"
#include "token_cache.h"

namespace {

uint64_t load_le(const std::string& bytes, size_t offset, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(bytes[offset + i]);
  return v;
}

void store_le(std::string& bytes, size_t offset, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) bytes[offset + i] = static_cast<char>(v >> (8 * i));
}

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "token_cache_fuzz: %s\n", what.c_str());
  std::abort();
}

// The outcome of one read: tokens, or the refusal's message without the file's name.
struct Outcome {
  bool ok = false;
  std::vector<uint16_t> tokens;
  std::string problem;
};

template <typename Read>
Outcome attempt(Read&& read, const std::string& name) {
  Outcome o;
  try {
    o.tokens = read();
    o.ok = true;
  } catch (const gpt2::TokenCacheError& e) {
    const std::string what = e.cause();
    const std::string prefix = "token cache " + name + ": ";
    if (what.compare(0, prefix.size(), prefix) != 0)
      bug("message does not name the cache: " + what);
    o.problem = what.substr(prefix.size());
  }
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const unsigned mode = data[0];
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  uint64_t key = 0;
  int64_t vocab = 256;
  if (bytes.size() >= gpt2::kTokenCacheHeaderBytes) {
    key = load_le(bytes, 24, 8);
    vocab = static_cast<int64_t>(load_le(bytes, 12, 4));
    if (vocab < 1 || vocab > 65536) vocab = 65536;
    if ((mode & 1) != 0) {
      const size_t payload = bytes.size() - gpt2::kTokenCacheHeaderBytes;
      store_le(bytes, 32, dtrain::crc32c(0, bytes.data() + gpt2::kTokenCacheHeaderBytes, payload),
               4);
      store_le(bytes, 36, dtrain::crc32c(0, bytes.data(), 36), 4);
    }
  }

  const Outcome decoded = attempt(
      [&] { return gpt2::decode_token_cache(bytes, key, vocab, "fuzz.tokens"); }, "fuzz.tokens");
  if (decoded.ok) {
    for (const uint16_t t : decoded.tokens) {
      if (t >= vocab) bug("accepted an id outside the vocabulary");
    }
    if (gpt2::encode_token_cache(decoded.tokens, key, vocab) != bytes) {
      bug("accepted bytes that do not re-encode to themselves");
    }
  }

  if ((mode & 2) != 0) {
    const std::string path = "/tmp/token_cache_fuzz." + std::to_string(::getpid());
    if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
      const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
      if (std::fclose(f) == 0 && written) {
        const Outcome read =
            attempt([&] { return gpt2::read_token_cache(path, key, vocab); }, path);
        if (read.ok != decoded.ok || read.tokens != decoded.tokens ||
            read.problem != decoded.problem) {
          bug("the file reader disagrees with the byte reader: '" + read.problem + "' vs '" +
              decoded.problem + "'");
        }
      }
      std::remove(path.c_str());
    }
  }
  return 0;
}

#include "token_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "dtrain/crc32c.h"

namespace gpt2 {
namespace {

bool host_is_little_endian() {
  const uint16_t one = 1;
  unsigned char first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

// The cache stores little-endian tokens; swapping on the (rare) big-endian host keeps a
// cache file portable.
void to_or_from_little_endian(std::vector<uint16_t>& tokens) {
  if (host_is_little_endian()) return;
  for (uint16_t& t : tokens) t = static_cast<uint16_t>((t >> 8) | (t << 8));
}

constexpr char kMagic[8] = {'D', 'T', 'R', 'N', 'T', 'O', 'K', '\0'};

// The header's fields; on disk they are little-endian at the offsets data.h gives.
struct CacheHeader {
  uint32_t version = 0;
  uint32_t vocab_size = 0;
  uint64_t num_tokens = 0;
  uint64_t key = 0;
  uint32_t tokens_crc = 0;
};

uint64_t load_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void store_le(unsigned char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint32_t crc32c(const void* data, size_t n) { return dtrain::crc32c(0, data, n); }

[[noreturn]] void cache_error(TokenCacheError::Kind kind, const std::string& name,
                              const std::string& problem) {
  throw TokenCacheError(kind, "token cache " + name + ": " + problem);
}

// Checks everything the header alone can tell, given the size of the whole file.
CacheHeader parse_header(const unsigned char* h, uint64_t file_size, uint64_t key,
                         int64_t vocab_size, const std::string& name) {
  using Kind = TokenCacheError::Kind;
  if (file_size < kTokenCacheHeaderBytes) {
    cache_error(Kind::kCorrupt, name,
                std::to_string(file_size) + " bytes, shorter than its " +
                    std::to_string(kTokenCacheHeaderBytes) + "-byte header");
  }
  if (std::memcmp(h, kMagic, sizeof(kMagic)) != 0) {
    cache_error(Kind::kCorrupt, name, "not a token cache (bad magic)");
  }
  CacheHeader header;
  header.version = static_cast<uint32_t>(load_le(h + 8, 4));
  if (header.version != kTokenCacheVersion) {
    cache_error(Kind::kStale, name,
                "format version " + std::to_string(header.version) + ", this build reads " +
                    std::to_string(kTokenCacheVersion));
  }
  const uint32_t header_crc = static_cast<uint32_t>(load_le(h + 36, 4));
  if (crc32c(h, 36) != header_crc) cache_error(Kind::kCorrupt, name, "header checksum mismatch");
  header.vocab_size = static_cast<uint32_t>(load_le(h + 12, 4));
  header.num_tokens = load_le(h + 16, 8);
  header.key = load_le(h + 24, 8);
  header.tokens_crc = static_cast<uint32_t>(load_le(h + 32, 4));
  if (header.vocab_size != static_cast<uint64_t>(vocab_size)) {
    cache_error(Kind::kStale, name,
                "written for a vocabulary of " + std::to_string(header.vocab_size) +
                    " ids, the tokenizer has " + std::to_string(vocab_size));
  }
  if (header.key != key) {
    cache_error(Kind::kStale, name, "written for another source or tokenizer (key differs)");
  }
  // Divide rather than multiply: a huge count must not wrap into a matching size.
  const uint64_t payload = file_size - kTokenCacheHeaderBytes;
  if (payload % sizeof(uint16_t) != 0 || header.num_tokens != payload / sizeof(uint16_t)) {
    cache_error(Kind::kCorrupt, name,
                "the header says " + std::to_string(header.num_tokens) + " tokens, but " +
                    std::to_string(payload) + " bytes follow it");
  }
  return header;
}

// `tokens` as read from the file (little-endian): checksum, byte order, ids in range.
void check_tokens(std::vector<uint16_t>& tokens, const CacheHeader& header, int64_t vocab_size,
                  const std::string& name) {
  const uint32_t crc = crc32c(tokens.data(), tokens.size() * sizeof(uint16_t));
  if (crc != header.tokens_crc) {
    cache_error(TokenCacheError::Kind::kCorrupt, name, "token checksum mismatch");
  }
  to_or_from_little_endian(tokens);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab_size) {
      cache_error(TokenCacheError::Kind::kCorrupt, name,
                  "token " + std::to_string(i) + " is id " + std::to_string(tokens[i]) +
                      ", outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
  }
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::string encode_token_cache(const std::vector<uint16_t>& tokens, uint64_t key,
                               int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > 65536) {
    throw dtrain::InvalidArgument("encode_token_cache: vocab_size " + std::to_string(vocab_size) +
                                  " is not in [1, 65536]");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab_size) {
      throw dtrain::InvalidArgument("encode_token_cache: token " + std::to_string(i) + " is id " +
                                    std::to_string(tokens[i]) + ", outside [0, " +
                                    std::to_string(vocab_size) + ")");
    }
  }
  std::vector<uint16_t> le = tokens;
  to_or_from_little_endian(le);
  const size_t payload = le.size() * sizeof(uint16_t);
  std::string bytes(kTokenCacheHeaderBytes + payload, '\0');
  auto* h = reinterpret_cast<unsigned char*>(bytes.data());
  std::memcpy(h, kMagic, sizeof(kMagic));
  store_le(h + 8, kTokenCacheVersion, 4);
  store_le(h + 12, static_cast<uint64_t>(vocab_size), 4);
  store_le(h + 16, le.size(), 8);
  store_le(h + 24, key, 8);
  store_le(h + 32, crc32c(le.data(), payload), 4);
  store_le(h + 36, crc32c(h, 36), 4);
  if (payload > 0) std::memcpy(h + kTokenCacheHeaderBytes, le.data(), payload);
  return bytes;
}

std::vector<uint16_t> decode_token_cache(std::string_view bytes, uint64_t key, int64_t vocab_size,
                                         const std::string& name) {
  const auto* h = reinterpret_cast<const unsigned char*>(bytes.data());
  const CacheHeader header = parse_header(h, bytes.size(), key, vocab_size, name);
  std::vector<uint16_t> tokens(header.num_tokens);
  if (!tokens.empty()) {
    std::memcpy(tokens.data(), h + kTokenCacheHeaderBytes, tokens.size() * sizeof(uint16_t));
  }
  check_tokens(tokens, header, vocab_size, name);
  return tokens;
}

// Reads exactly `n` bytes unless the file ends first; returns how many were read.
static size_t read_fully(int fd, void* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::read(fd, static_cast<char*>(out) + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

std::vector<uint16_t> read_token_cache(const std::filesystem::path& path, uint64_t key,
                                       int64_t vocab_size) {
  using Kind = TokenCacheError::Kind;
  const std::string name = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) cache_error(Kind::kStale, name, "cannot open: " + errno_text());
  // The size of the file opened, not of whatever the path names by now.
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }
  } close_fd{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) cache_error(Kind::kCorrupt, name, "cannot stat: " + errno_text());
  if (!S_ISREG(st.st_mode)) cache_error(Kind::kCorrupt, name, "not a regular file");
  const auto file_size = static_cast<uint64_t>(st.st_size);
  unsigned char h[kTokenCacheHeaderBytes] = {};
  if (read_fully(fd, h, sizeof(h)) != std::min<uint64_t>(sizeof(h), file_size)) {
    cache_error(Kind::kCorrupt, name, "cannot read its header: " + errno_text());
  }
  const CacheHeader header = parse_header(h, file_size, key, vocab_size, name);
  std::vector<uint16_t> tokens(header.num_tokens);
  const size_t payload = tokens.size() * sizeof(uint16_t);
  if (read_fully(fd, tokens.data(), payload) != payload) {
    cache_error(Kind::kCorrupt, name,
                "ended before its " + std::to_string(payload) + " token bytes were read");
  }
  check_tokens(tokens, header, vocab_size, name);
  return tokens;
}

}  // namespace gpt2

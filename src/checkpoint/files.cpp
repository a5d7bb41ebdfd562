#include "checkpoint/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "dtrain/crc32c.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint {
namespace {

[[noreturn]] void fail_errno(const std::string& path, const char* what) {
  throw CheckpointError(fmt::format("{}: {}: {}", path, what, std::strerror(errno)));
}

int open_read(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno(path, "cannot open");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail_errno(path, "cannot stat");
  }
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

}  // namespace

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail_errno(path_, "cannot create");
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  // Checksum chunk by chunk, as the bytes will be read back.
  size_t left = n;
  const uint8_t* q = p;
  while (left > 0) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(left, kChunkBytes - chunk_fill_));
    chunk_crc_ = crc32c(chunk_crc_, q, take);
    chunk_fill_ += take;
    q += take;
    left -= take;
    if (chunk_fill_ == kChunkBytes) {
      digest_.chunk_crcs.push_back(chunk_crc_);
      chunk_crc_ = 0;
      chunk_fill_ = 0;
    }
  }
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_errno(path_, "write failed");
    }
    p += w;
    n -= static_cast<size_t>(w);
    digest_.size += static_cast<uint64_t>(w);
  }
}

FileDigest FileWriter::finish() {
  if (chunk_fill_ > 0) digest_.chunk_crcs.push_back(chunk_crc_);
  chunk_fill_ = 0;
  if (::fsync(fd_) != 0) fail_errno(path_, "fsync failed");
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail_errno(path_, "close failed");
  }
  fd_ = -1;
  return digest_;
}

void read_exact(int fd, const std::string& path, uint64_t offset, void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "read failed");
    }
    if (r == 0) {
      throw CheckpointError(fmt::format("{}: truncated: no bytes at offset {}", path, offset));
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

MappedFile::MappedFile(std::string path) : path_(std::move(path)) {
  const int fd = open_read(path_, &size_);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      errno = err;
      fail_errno(path_, "cannot map");
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void MappedFile::read(uint64_t offset, void* out, size_t n) {
  if (offset > size_ || n > size_ - offset) {
    throw CheckpointError(fmt::format("{}: truncated: bytes [{}, {}) requested, the file has {}",
                                      path_, offset, offset + n, size_));
  }
  if (n == 0) return;
  std::memcpy(out, data_ + offset, n);
  bytes_read_ += n;
}

void MappedFile::release(uint64_t offset, uint64_t n) {
  if (data_ == nullptr || offset >= size_ || n == 0) return;
  n = std::min<uint64_t>(n, size_ - offset);
  // Whole pages, widened outwards: a neighbour's page dropped too is only faulted back later.
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page;
  const uint64_t end = std::min<uint64_t>((offset + n + page - 1) / page * page, size_);
  // Clean pages of a read-only shared file mapping: dropping them loses nothing.
  ::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_DONTNEED);
}

VerifiedFile::VerifiedFile(std::string path, FileDigest expected)
    : path_(std::move(path)), expected_(std::move(expected)) {
  uint64_t actual = 0;
  fd_ = open_read(path_, &actual);
  const uint64_t chunks = (expected_.size + expected_.chunk_bytes - 1) / expected_.chunk_bytes;
  if (actual != expected_.size || expected_.chunk_crcs.size() != chunks) {
    ::close(fd_);
    throw CheckpointError(
        fmt::format("{}: {}: the file has {} bytes, the manifest records {}", path_,
                    actual < expected_.size ? "truncated" : "size differs from the manifest",
                    actual, expected_.size));
  }
  verified_.assign(chunks, false);
}

VerifiedFile::~VerifiedFile() { ::close(fd_); }

void VerifiedFile::read(uint64_t offset, void* out, size_t n) {
  if (offset > expected_.size || n > expected_.size - offset) {
    throw CheckpointError(fmt::format("{}: bytes [{}, {}) requested, the file has {}", path_,
                                      offset, offset + n, expected_.size));
  }
  if (n == 0) return;
  const uint64_t cb = expected_.chunk_bytes;
  const uint64_t first = offset / cb, last = (offset + n - 1) / cb;
  // Read whole chunks: each is verified once, then copied out.
  for (uint64_t k = first; k <= last; ++k) {
    const uint64_t begin = k * cb;
    const uint64_t len = std::min(cb, expected_.size - begin);
    const uint64_t lo = std::max(offset, begin), hi = std::min(offset + n, begin + len);
    auto* dst = static_cast<uint8_t*>(out) + (lo - offset);
    if (k == last_chunk_index_) {
      std::memcpy(dst, last_chunk_.data() + (lo - begin), hi - lo);
      continue;
    }
    if (verified_[k]) {
      read_exact(fd_, path_, lo, dst, hi - lo);
      bytes_read_ += hi - lo;
      continue;
    }
    last_chunk_index_ = UINT64_MAX;  // until the new contents are verified
    last_chunk_.resize(len);
    read_exact(fd_, path_, begin, last_chunk_.data(), len);
    bytes_read_ += len;
    if (crc32c(0, last_chunk_.data(), len) != expected_.chunk_crcs[k]) {
      throw CheckpointError(
          fmt::format("{}: checksum mismatch in bytes [{}, {}): the file is corrupted", path_,
                      begin, begin + len));
    }
    verified_[k] = true;
    last_chunk_index_ = k;
    std::memcpy(dst, last_chunk_.data() + (lo - begin), hi - lo);
  }
}

std::string read_small_file(const std::string& path, uint64_t limit) {
  uint64_t size = 0;
  const int fd = open_read(path, &size);
  if (size > limit) {
    ::close(fd);
    throw CheckpointError(
        fmt::format("{}: {} bytes, more than the {}-byte limit for this file", path, size, limit));
  }
  std::string text(size, '\0');
  try {
    read_exact(fd, path, 0, text.data(), size);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

FileDigest write_small_file(const std::string& path, const std::string& text) {
  FileWriter w(path);
  w.write(text.data(), text.size());
  return w.finish();
}

void fsync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail_errno(path, "cannot open directory");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail_errno(path, "fsync of directory failed");
}

}  // namespace dtrain::checkpoint

#include "comm/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace dtrain::shm {
namespace {

constexpr size_t kAlign = 64;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

size_t slots_offset() { return round_up(sizeof(SegmentHeader), kAlign); }
size_t data_offset(int world) {
  return round_up(slots_offset() + sizeof(RankSlot) * static_cast<size_t>(world), 4096);
}
size_t total_bytes(int world, size_t chunk) {
  return data_offset(world) + 2 * static_cast<size_t>(world) * chunk;
}

[[noreturn]] void fail(const std::string& name, const std::string& what, int err) {
  throw CommError(fmt::format("shared-memory segment {}: {}: {}", name, what, std::strerror(err)));
}

}  // namespace

const char* to_string(RankState s) {
  switch (s) {
    case RankState::kJoining:
      return "joining";
    case RankState::kReady:
      return "ready";
    case RankState::kFailed:
      return "failed";
    case RankState::kLeft:
      return "left";
  }
  return "?";
}

Segment Segment::create(const std::string& name, int world_size, size_t chunk_bytes) {
  // Every rank's region of a reduce-scatter chunk must hold one element of 8 bytes.
  chunk_bytes =
      round_up(std::max({chunk_bytes, kAlign, 8 * static_cast<size_t>(world_size)}), kAlign);
  const size_t bytes = total_bytes(world_size, chunk_bytes);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST)
      throw CommError(
          fmt::format("shared-memory segment {} exists: a stale or foreign segment "
                      "(left alone)",
                      name));
    fail(name, "shm_open(O_CREAT|O_EXCL)", err);
  }
  void* base = MAP_FAILED;
  int err = 0;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    err = errno;
  } else {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) err = errno;
  }
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    fail(name, fmt::format("sizing and mapping {} bytes (is /dev/shm large enough?)", bytes), err);
  }
  auto* h = new (base) SegmentHeader();
  for (int r = 0; r < world_size; ++r)
    new (static_cast<char*>(base) + slots_offset() + sizeof(RankSlot) * r) RankSlot();
  h->world_size = world_size;
  h->chunk_bytes = chunk_bytes;
  h->total_bytes = bytes;
  h->version = SegmentHeader::kVersion;
  // Written last: a segment whose magic is set is complete.
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = SegmentHeader::kMagic;
  return Segment(name, base, bytes);
}

Segment Segment::open(const std::string& name, int world_size) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail(name, "shm_open", errno);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    fail(name, "fstat", err);
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  if (bytes < data_offset(1)) {
    close(fd);
    throw CommError(
        fmt::format("shared-memory segment {} is {} bytes: not a dtrain segment", name, bytes));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (base == MAP_FAILED) fail(name, "mmap", err);
  Segment seg(name, base, bytes);
  std::atomic_thread_fence(std::memory_order_acquire);
  const SegmentHeader& h = seg.header();
  if (h.magic != SegmentHeader::kMagic || h.version != SegmentHeader::kVersion ||
      h.total_bytes != bytes) {
    throw CommError(fmt::format("shared-memory segment {} is not a dtrain segment of version {}",
                                name, SegmentHeader::kVersion));
  }
  if (h.world_size != world_size || bytes != total_bytes(world_size, h.chunk_bytes)) {
    throw CommError(
        fmt::format("shared-memory segment {} is for {} ranks, this communicator has {}", name,
                    h.world_size, world_size));
  }
  return seg;
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)), base_(other.base_), bytes_(other.bytes_) {
  other.base_ = nullptr;
  other.bytes_ = 0;
}

Segment::~Segment() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

RankSlot& Segment::slot(int rank) const {
  return *reinterpret_cast<RankSlot*>(static_cast<char*>(base_) + slots_offset() +
                                      sizeof(RankSlot) * static_cast<size_t>(rank));
}

char* Segment::buffer(int set, int rank) const {
  const size_t chunk = chunk_bytes();
  return static_cast<char*>(base_) + data_offset(world_size()) +
         (static_cast<size_t>(set) * static_cast<size_t>(world_size()) +
          static_cast<size_t>(rank)) *
             chunk;
}

bool unlink_segment(const std::string& name) { return shm_unlink(name.c_str()) == 0; }

std::string segment_name(const std::string& job_id) {
  return fmt::format("/dtrain-{}-{}-{}", getuid(), getpid(), job_id);
}

std::string random_job_id() {
  uint64_t x = 0;
  if (getrandom(&x, sizeof(x), 0) != static_cast<ssize_t>(sizeof(x))) {
    // Entropy pool not ready (early boot): time and address differ between jobs anyway.
    x = static_cast<uint64_t>(time(nullptr)) * 0x9E3779B97F4A7C15ull ^
        reinterpret_cast<uintptr_t>(&x);
  }
  return fmt::format("{:016x}", x);
}

Segment create_unique_segment(int world_size, size_t chunk_bytes,
                              const std::function<std::string()>& next_id) {
  for (int attempt = 0;; ++attempt) {
    try {
      return Segment::create(segment_name(next_id()), world_size, chunk_bytes);
    } catch (const CommError& e) {
      if (attempt == 7 || std::string(e.what()).find(" exists:") == std::string::npos) throw;
    }
  }
}

}  // namespace dtrain::shm

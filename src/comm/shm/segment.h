// One POSIX shared-memory segment per communicator: a header, one slot per rank (its
// barrier word, state, pid and the consistency headers) and two sets of per-rank data
// buffers (chunk k of a call uses set k % 2, so ranks copy chunk k out while others already
// copy chunk k + 1 in).
//
// Naming and cleanup: rank 0 creates "/dtrain-<uid>-<pid>-<random>" with O_EXCL (a stale
// segment of a crashed job can never be opened by mistake), and the name is unlinked as
// soon as every rank mapped it, so a later crash leaves nothing in /dev/shm.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "comm/call_header.h"

namespace dtrain::shm {

enum class RankState : uint32_t {
  kJoining = 0,
  kReady = 1,
  kFailed = 2,  // its communicator broke: it will not take part in further calls
  kLeft = 3,    // its communicator was destroyed
};

const char* to_string(RankState s);

struct alignas(64) RankSlot {
  std::atomic<uint32_t> arrived{0};   // futex word: the last barrier generation reached
  std::atomic<uint32_t> sleepers{0};  // peers in futex_wait on `arrived`
  std::atomic<uint32_t> state{0};     // RankState; waking: futex_wake on `arrived`
  std::atomic<int32_t> pid{0};
  std::atomic<uint64_t> start_time{0};
  detail::CallHeader headers[2];  // collective #s uses headers[s % 2]
};

struct alignas(64) SegmentHeader {
  static constexpr uint32_t kMagic = 0x64745348;  // "dtSH"
  static constexpr uint32_t kVersion = 1;
  uint32_t magic = 0;
  uint32_t version = 0;
  int32_t world_size = 0;
  uint32_t reserved = 0;
  uint64_t chunk_bytes = 0;  // one rank's buffer in one set
  uint64_t total_bytes = 0;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "atomics shared between processes must be lock-free");

// A mapped segment. Move-only; unmaps on destruction (never unlinks: see unlink_segment).
class Segment {
 public:
  // Creates and initialises `name` exclusively. Throws CommError naming the segment if it
  // already exists ("exists: a stale or foreign segment") or cannot be created or sized.
  static Segment create(const std::string& name, int world_size, size_t chunk_bytes);
  // Maps an existing segment and checks it is a dtrain segment of `world_size` ranks.
  // Throws CommError naming it otherwise.
  static Segment open(const std::string& name, int world_size);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&&) = delete;
  Segment(const Segment&) = delete;
  ~Segment();

  const std::string& name() const { return name_; }
  int world_size() const { return header().world_size; }
  size_t chunk_bytes() const { return static_cast<size_t>(header().chunk_bytes); }
  const SegmentHeader& header() const { return *static_cast<const SegmentHeader*>(base_); }
  RankSlot& slot(int rank) const;
  // Rank `rank`'s buffer of set `set` (0 or 1): chunk_bytes() bytes, 64-byte aligned.
  char* buffer(int set, int rank) const;

 private:
  Segment(std::string name, void* base, size_t bytes)
      : name_(std::move(name)), base_(base), bytes_(bytes) {}

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// Removes the name (mapped segments stay usable). False if it did not exist.
bool unlink_segment(const std::string& name);

// "/dtrain-<uid>-<pid>-<job_id>".
std::string segment_name(const std::string& job_id);

// 16 random hex digits (getrandom).
std::string random_job_id();

// Segment::create under segment_name(next_id()), with a new id when the name exists (at
// most 8 tries): a stale segment never blocks a new job. Throws what the last try threw.
Segment create_unique_segment(int world_size, size_t chunk_bytes,
                              const std::function<std::string()>& next_id = random_job_id);

}  // namespace dtrain::shm

#include "comm/shm/barrier.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/errors.h"

namespace dtrain::shm {
namespace {

constexpr auto kSlice = std::chrono::milliseconds(20);
constexpr int kSpins = 256;

uint32_t* word(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

// Shared (not FUTEX_PRIVATE_FLAG) futexes: the word lives in memory other processes map.
void futex_wait(std::atomic<uint32_t>& a, uint32_t expected, std::chrono::nanoseconds for_at_most) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(for_at_most.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(for_at_most.count() % 1000000000);
  syscall(SYS_futex, word(a), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& a) {
  syscall(SYS_futex, word(a), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Generations wrap after 2^32 barriers; compare by signed distance.
bool reached(uint32_t arrived, uint32_t generation) {
  return static_cast<int32_t>(arrived - generation) >= 0;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

Barrier::Barrier(const Segment& segment, int rank, std::vector<int> global_ranks)
    : segment_(segment),
      rank_(rank),
      world_size_(segment.world_size()),
      own_pid_(static_cast<int32_t>(getpid())),
      global_ranks_(std::move(global_ranks)) {}

void Barrier::set_state(RankState state) {
  RankSlot& me = segment_.slot(rank_);
  const auto failed = static_cast<uint32_t>(RankState::kFailed);
  uint32_t current = me.state.load();
  while (current != failed &&
         !me.state.compare_exchange_weak(current, static_cast<uint32_t>(state))) {
  }
  futex_wake_all(me.arrived);
}

void Barrier::arrive_and_wait(Clock::time_point deadline, std::chrono::milliseconds timeout,
                              const std::string& step) {
  const uint32_t g = ++generation_;
  RankSlot& me = segment_.slot(rank_);
  // seq_cst store, then seq_cst load of `sleepers`: pairs with the waiter's increment of
  // `sleepers` before its futex_wait re-checks the word, so no wake-up is lost.
  me.arrived.store(g);
  if (me.sleepers.load() > 0) futex_wake_all(me.arrived);
  for (int k = 1; k < world_size_; ++k) {
    wait_for((rank_ + k) % world_size_, g, deadline, timeout, step);
  }
}

void Barrier::wait_for(int peer, uint32_t g, Clock::time_point deadline,
                       std::chrono::milliseconds timeout, const std::string& step) {
  RankSlot& p = segment_.slot(peer);
  for (int i = 0; i < kSpins; ++i) {
    if (reached(p.arrived.load(std::memory_order_acquire), g)) return;
    cpu_relax();
  }
  for (;;) {
    const uint32_t seen = p.arrived.load(std::memory_order_acquire);
    if (reached(seen, g)) return;
    check_peer(peer);
    const auto now = Clock::now();
    if (now >= deadline) fail_missing(g, timeout, step);
    p.sleepers.fetch_add(1);
    futex_wait(p.arrived, seen, std::min<Clock::duration>(kSlice, deadline - now));
    p.sleepers.fetch_sub(1);
  }
}

void Barrier::check_peer(int peer) const {
  const RankSlot& p = segment_.slot(peer);
  const auto state = static_cast<RankState>(p.state.load());
  if (state == RankState::kFailed) {
    throw CommError(fmt::format("rank {} failed (its communicator broke) and will not take part",
                                global(peer)));
  }
  if (state == RankState::kLeft) {
    throw CommError(fmt::format("rank {} left: its communicator was destroyed", global(peer)));
  }
  const ProcessId id{p.pid.load(), p.start_time.load()};
  if (id.pid != own_pid_ && !process_alive(id)) {
    throw CommError(fmt::format("rank {} (pid {}) exited or was killed", global(peer), id.pid));
  }
}

void Barrier::fail_missing(uint32_t g, std::chrono::milliseconds timeout, const std::string& step) {
  std::vector<int> missing;
  for (int r = 0; r < world_size_; ++r) {
    if (!reached(segment_.slot(r).arrived.load(), g)) missing.push_back(global(r));
  }
  throw TimeoutError(
      fmt::format("rank(s) {} did not {} within {} ms (slow, hung, or they "
                  "issued fewer collectives)",
                  fmt::join(missing, ", "), step, timeout.count()));
}

}  // namespace dtrain::shm

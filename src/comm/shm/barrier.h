// The one synchronisation the shared-memory collectives use: a barrier over the ranks'
// slots. Rank r announces generation g by storing it in its slot's `arrived` word and waits
// until every slot holds g or later: no shared counter to reset, and a rank that is ahead
// never disturbs one that is behind.
//
// Waiting spins briefly, then sleeps in futex_wait in slices of at most 20 ms. Between
// slices it checks the deadline (TimeoutError naming the missing ranks), each missing
// peer's state (kFailed/kLeft: CommError at once) and, for peers in other processes,
// whether the process still runs (CommError naming rank and pid). No wait is unbounded.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/shm/host.h"
#include "comm/shm/segment.h"

namespace dtrain::shm {

using Clock = std::chrono::steady_clock;

class Barrier {
 public:
  // `global_ranks[r]`: the communicator rank of segment rank r, for messages (empty: the
  // same numbers; the hierarchical transport's segments hold one host's ranks).
  Barrier(const Segment& segment, int rank, std::vector<int> global_ranks = {});

  // Arrives at the next generation and waits for every rank. `step` says what late ranks
  // did not do ("issue collective #17", "reach chunk 3/8 of all_reduce #17"). Throws TimeoutError
  // when `deadline` passes, CommError when a missing peer failed, left or died.
  void arrive_and_wait(Clock::time_point deadline, std::chrono::milliseconds timeout,
                       const std::string& step);

  // Publishes this rank's state and wakes every peer that sleeps on it. kFailed is final:
  // a failed rank that then leaves stays kFailed, so peers report the failure, not the exit.
  void set_state(RankState state);

 private:
  void wait_for(int peer, uint32_t generation, Clock::time_point deadline,
                std::chrono::milliseconds timeout, const std::string& step);
  [[noreturn]] void fail_missing(uint32_t generation, std::chrono::milliseconds timeout,
                                 const std::string& step);
  void check_peer(int peer) const;
  int global(int r) const {
    return global_ranks_.empty() ? r : global_ranks_[static_cast<size_t>(r)];
  }

  const Segment& segment_;
  const int rank_;
  const int world_size_;
  const int32_t own_pid_;
  const std::vector<int> global_ranks_;
  uint32_t generation_ = 0;
};

}  // namespace dtrain::shm

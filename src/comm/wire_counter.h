// Counting bytes on the wire (dtrain/wire_stats.h, docs/communication.md "Bytes on the
// wire"): engines call WireTally::sent where they hand payload to a peer, or to the shared
// segment, with the kind of the user's call; the front end reads the counter.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/call_header.h"
#include "dtrain/wire_stats.h"

namespace dtrain::detail {

enum class WireKind : uint8_t {
  kAllReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kPointToPoint,
  kControl,
};
constexpr size_t kWireKinds = 6;

// The kind a collective's payload counts as (a barrier moves no payload: kControl).
WireKind wire_kind(CollectiveOp op);

// One communicator's counts. Thread-safe: engines add from their executor threads.
class WireCounter {
 public:
  void add(WireKind kind, bool inter_host, uint64_t bytes) {
    counts_[static_cast<size_t>(kind) * 2 + (inter_host ? 1 : 0)].fetch_add(
        bytes, std::memory_order_relaxed);
  }
  WireStats snapshot() const;  // counted = true

 private:
  std::array<std::atomic<uint64_t>, kWireKinds * 2> counts_{};
};

// What an engine needs to count: the communicator's counter and, for each rank of the
// engine's group (a leaders' group numbers hosts, not ranks), the index of its host.
struct WireTally {
  std::shared_ptr<WireCounter> counter;  // never null
  std::vector<int> host_of;              // group rank -> host index

  // `me` sent `bytes` of payload to group rank `peer`.
  void sent(WireKind kind, int me, int peer, uint64_t bytes) const {
    if (bytes == 0) return;
    counter->add(kind, host_of[static_cast<size_t>(me)] != host_of[static_cast<size_t>(peer)],
                 bytes);
  }
  // Bytes written into this host's shared-memory segment for the host's other ranks.
  void shared(WireKind kind, uint64_t bytes) const {
    if (bytes > 0) counter->add(kind, false, bytes);
  }
};

}  // namespace dtrain::detail

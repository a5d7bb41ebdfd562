// Shared-memory transport: collectives between ranks of one host through one POSIX
// shared-memory segment per communicator (segment.h), synchronised by a futex barrier whose
// every wait is bounded by the call's timeout and notices failed, departed and dead peers
// (barrier.h). Point-to-point calls go through a Gloo transport, posted from this transport's
// executor so that they keep their order relative to collectives.
//
// Set-up: join_segment (setup.h).
#pragma once

#include <memory>

#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/shm/segment.h"
#include "comm/wire_counter.h"

namespace dtrain::shm {

// A transport over `segment`, which every rank has joined. `p2p` carries send/recv. Counts
// the bytes each rank writes into the segment in `wire`, as intra-host.
std::unique_ptr<detail::CollectiveEngine> make_shm_transport(
    Segment segment, std::shared_ptr<Store> store, int rank, int world_size,
    std::shared_ptr<detail::StickyFailure> failure, std::shared_ptr<detail::WireCounter> wire,
    std::unique_ptr<detail::CollectiveEngine> p2p);

}  // namespace dtrain::shm

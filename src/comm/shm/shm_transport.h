// Shared-memory transport: collectives between ranks of one host through one POSIX
// shared-memory segment per communicator (segment.h), synchronised by a futex barrier whose
// every wait is bounded by the call's timeout and notices failed, departed and dead peers
// (barrier.h). Point-to-point calls go through a Gloo transport, posted from this transport's
// executor so that they keep their order relative to collectives.
//
// Set-up: join_segment (setup.h).
#pragma once

#include <memory>

#include "comm/failure.h"
#include "comm/shm/segment.h"
#include "comm/transport.h"

namespace dtrain::shm {

// A transport over `segment`, which every rank has joined. `p2p` carries send/recv.
std::unique_ptr<detail::Transport> make_shm_transport(
    Segment segment, std::shared_ptr<Store> store, int rank, int world_size,
    std::shared_ptr<detail::StickyFailure> failure, std::unique_ptr<detail::Transport> p2p);

}  // namespace dtrain::shm

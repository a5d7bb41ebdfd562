// Setting up shared memory for one communicator: how its ranks come to map one segment.
// Which transport they use is decided in backend_factory.h (make_cpu_engine).
#pragma once

#include <memory>
#include <optional>

#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/shm/segment.h"

namespace dtrain::shm {

// Rank 0 creates the segment under a fresh random name and publishes the name in the
// store; every rank maps it, records its pid and waits (bounded by options.timeout) until
// all have; then the name is unlinked. Whatever fails, the name is unlinked before the
// error leaves, so nothing is left in /dev/shm. If rank 0 cannot create a segment, every
// rank learns why: with `required`, all throw CommError naming the cause; otherwise all
// return nullopt (the caller falls back to Gloo). Throws TimeoutError naming the ranks that
// did not map it in time.
std::optional<Segment> join_segment(Store& store, int rank, int world_size,
                                    const CommunicatorOptions& options, bool required);

}  // namespace dtrain::shm

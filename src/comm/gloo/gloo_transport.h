// Gloo's TCP pairs: a collective engine (comm/engine.h) for CPU tensors. Argument checks,
// numbering and per-call timeouts are the front end's (comm/front_end.h); this engine runs
// calls within them and records what fails in the shared sticky failure.
//
// Every call runs on one executor thread per communicator, in issue order, so compute on
// the caller's thread overlaps communication and every rank runs collectives in the same
// order. A collective first exchanges its header with every peer (header_exchange.h) and
// moves data only if all ranks agree. Point-to-point transfers are posted on the executor
// (keeping their order relative to collectives) and completed on a second thread, so that a
// send waiting for its peer does not hold up later collectives.
#pragma once

#include <memory>

#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/wire_counter.h"

namespace dtrain::gloo_backend {

// Connects `world_size` ranks through `store` (keys under "dtrain/gloo/<options.name>/").
// Throws TimeoutError if not every rank joined within options.timeout, InvalidArgument for a
// bad listening interface or address, CommError for other transport failures. Counts what it
// sends in `wire` (wire.host_of: one entry per rank of this group), under the kind of each
// call it runs.
std::unique_ptr<detail::CollectiveEngine> make_gloo_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, detail::WireTally wire);

}  // namespace dtrain::gloo_backend

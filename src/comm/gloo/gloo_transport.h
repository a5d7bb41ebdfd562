// Gloo backend: CPU tensors over Gloo's TCP transport. Transport code only; argument checks,
// numbering, timeouts and the sticky failure are the front end's (comm/front_end.h).
//
// Every call runs on one executor thread per communicator, in issue order, so compute on
// the caller's thread overlaps communication and every rank runs collectives in the same
// order. A collective first exchanges its header with every peer (header_exchange.h) and
// moves data only if all ranks agree. Point-to-point transfers are posted on the executor
// (keeping their order relative to collectives) and completed on a second thread, so that a
// send waiting for its peer does not hold up later collectives.
#pragma once

#include <memory>

#include "comm/failure.h"
#include "comm/transport.h"

namespace dtrain::gloo_backend {

// Connects `world_size` ranks through `store` (keys under "dtrain/gloo/<options.name>/").
// Throws TimeoutError if not every rank joined within options.timeout, InvalidArgument for a
// bad listening interface or address, CommError for other transport failures.
std::unique_ptr<detail::Transport> make_gloo_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure);

}  // namespace dtrain::gloo_backend

// NCCL backend: CUDA tensors, one NCCL communicator and one CUDA stream per dtrain
// communicator. Calls are ordered after the caller's stream and return without blocking the
// host; a watchdog ends calls that fail or hang. Design and error model: docs/nccl.md.
// A collective engine (comm/engine.h): argument checks, numbering and timeouts are the front
// end's.
//
// Only the factory is declared here, so that no CUDA or NCCL header reaches code outside
// src/comm/nccl/.
#pragma once

#include <memory>

#include "comm/engine.h"
#include "comm/failure.h"

namespace dtrain::nccl_backend {

// Joins `world_size` ranks through `store`: rank 0 publishes NCCL's unique id under
// "dtrain/nccl/<options.name>/", the others read it. Uses CUDA device
// options.device_index, or the current device if it is negative. Throws InvalidArgument
// without a usable CUDA device, TimeoutError if not every rank joined within
// options.timeout, CommError if CUDA or NCCL fail.
std::unique_ptr<detail::CollectiveEngine> make_nccl_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure);

}  // namespace dtrain::nccl_backend

// MPI: a collective engine (comm/engine.h) for CPU tensors over an MPI communicator, for
// clusters whose fast network MPI reaches (UCX, verbs) and for applications that already hold
// an MPI_Comm (dtrain/mpi.h). Argument checks, numbering and per-call timeouts are the front
// end's; this engine runs calls as MPI's nonblocking operations within them.
//
// Every collective first all-gathers its CallHeader on a second communicator (the consistency
// check: a mismatch is a DesyncError on every rank before any data moves), then starts its data
// operation once every earlier collective has started its own, so that both communicators see
// the calls in issue order on every rank. Point-to-point calls start at once on the data
// communicator and complete on their own: a recv waiting for its peer holds up no collective.
// Collectives complete in issue order. A call not complete within its timeout fails with
// TimeoutError; MPI cannot cancel a collective, so the call is left to MPI (its tensors kept
// alive) and the communicator is broken. Threads: comm/mpi/mpi_runtime.h.
#pragma once

#include <mpi.h>

#include <memory>

#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/mpi/mpi_runtime.h"

namespace dtrain::mpi_backend {

// An engine over `comm`, which it takes over (and frees when it is destroyed): its ranks and
// size are the communicator's. Resolves options.mpi_progress against the runtime's thread
// level: InvalidArgument(ctx) for kThread where no dtrain thread may call MPI. `comm` must be
// valid and the call collective over it (it duplicates `comm` for the headers).
std::unique_ptr<detail::CollectiveEngine> make_mpi_engine(
    std::shared_ptr<Runtime> runtime, MPI_Comm comm, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, const ErrorContext& ctx);

}  // namespace dtrain::mpi_backend

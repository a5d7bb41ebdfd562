// Communicators of the MPI backend (Backend::kMpi): over ranks that make_communicator numbers
// through a store, or over an application's MPI_Comm (dtrain/mpi.h).
#pragma once

#include <memory>

#include "comm/engine.h"
#include "comm/failure.h"

namespace dtrain::mpi_backend {

// The engine for make_communicator(store, rank, world_size, {backend = kMpi}): MPI_COMM_WORLD's
// processes that hold these dtrain ranks, in dtrain's rank order (MPI_Comm_create_group, so a
// group of some of the job's ranks works too). Initializes MPI if nothing has. Every rank
// publishes its MPI_COMM_WORLD rank in `store`; InvalidArgument(ctx) when they do not form one
// MPI job (processes not started by an MPI launcher each see a world of their own),
// TimeoutError when a rank does not join within options.timeout.
std::unique_ptr<detail::CollectiveEngine> make_mpi_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, const ErrorContext& ctx);

}  // namespace dtrain::mpi_backend

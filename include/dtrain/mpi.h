// MPI: dtrain on an MPI communicator the application already holds, for in-situ training in
// simulation codes. Backend::kMpi itself (make_communicator, init_communicator(LaunchInfo),
// `gpt2_train --backend mpi`) needs only communicator.h; this header adds what takes an
// MPI_Comm, so only programs that include it need <mpi.h>. docs/communication.md, "MPI",
// states the thread model; docs/multinode.md shows jobs under mpirun and Slurm.
//
// clang-format off
//   MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // the application's MPI
//   MPI_Comm half;
//   MPI_Comm_split(MPI_COMM_WORLD, world_rank % 2, world_rank, &half);
//   if (world_rank % 2 == 0) {
//     auto comm = dtrain::init_communicator(half);  // ranks and size are half's
//     dtrain::DataParallel ddp(model, comm);        // train as under any launcher
//     train(ddp);
//   }  // destroy dtrain's communicators before MPI_Finalize
//   MPI_Finalize();
// clang-format on
#pragma once

#include "dtrain/config.h"

#if !DTRAIN_HAS_MPI
#error "this dtrain was built without MPI (DTRAIN_WITH_MPI=OFF, or no MPI found at configure time)"
#endif

#include <mpi.h>

#include "dtrain/communicator.h"

namespace dtrain {

// A communicator over the processes of `comm` (rank and world size are comm's), with
// Backend::kMpi whatever options.backend says. Collective over `comm`: dtrain duplicates it, so
// the application's own traffic on `comm` never mixes with dtrain's, and the application may
// keep using `comm` and any other communicator. The application owns MPI: it initialized MPI
// before this call (InvalidArgument otherwise) at any thread level, and destroys dtrain's
// communicators before MPI_Finalize. options.mpi_progress chooses who moves calls on
// (MpiProgress); at MPI_THREAD_FUNNELED and below dtrain's calls, and Work::wait(), must come
// from the main thread (InvalidArgument otherwise). Throws InvalidArgument for MPI_COMM_NULL.
CommunicatorPtr init_communicator(MPI_Comm comm, const CommunicatorOptions& options = {});

}  // namespace dtrain

// The one place where a communicator's collective engine (engine.h) is assembled, for every
// backend: NCCL; MPI; for Gloo, the CPU transport the ranks agree on (Gloo's TCP pairs, shared
// memory or hierarchical), wrapped in the staging engine for tensors of another device.
// make_communicator (communicator.cpp) validates the options and puts a FrontEnd on top.
#pragma once

#include <memory>
#include <string>

#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/wire_counter.h"

namespace dtrain::detail {

// Throws InvalidArgument(ctx) for options no backend accepts: a non-positive timeout, an
// enumerator out of range.
void check_options(const CommunicatorOptions& options, const ErrorContext& ctx);

// `engine`, wrapped in the staging engine when options.device is not the CPU (Gloo and MPI move
// host memory; see CommunicatorOptions::device).
std::unique_ptr<CollectiveEngine> on_device(std::unique_ptr<CollectiveEngine> engine,
                                            const CommunicatorOptions& options, int rank,
                                            std::shared_ptr<StickyFailure> failure,
                                            const ErrorContext& ctx);

// The engine of `options.backend`. `failure` and `wire` are the communicator's. For NCCL,
// `wire` is left untouched (NCCL chooses its algorithms itself: not counted). Throws what
// make_cpu_engine and the NCCL and staging factories throw, InvalidArgument for a backend
// not compiled in. `ctx` names rank and operation in those errors.
std::unique_ptr<CollectiveEngine> make_engine(std::shared_ptr<Store> store, int rank,
                                              int world_size, const CommunicatorOptions& options,
                                              std::shared_ptr<StickyFailure> failure,
                                              std::shared_ptr<WireCounter> wire,
                                              const ErrorContext& ctx);

// The CPU engine of a communicator. Every rank publishes its host identity (shm/host.h) and
// the transport it asks for; all then decide alike:
//  * kGloo asked by any rank: Gloo; kGloo and kSharedMemory both asked: InvalidArgument.
//  * all ranks on one host: shared memory (kAuto falls back to Gloo, with a note on stderr,
//    if rank 0 cannot create a segment);
//  * several hosts with the same number of ranks each: hierarchical
//    (shm/hierarchical_transport.h) when a host has two ranks or more or kSharedMemory was
//    asked, else Gloo;
//  * several hosts with different numbers of ranks: Gloo (kSharedMemory asked:
//    InvalidArgument naming two hosts).
// Point-to-point always goes through Gloo. The host identities also tell `wire` which
// peers are on this rank's host. `identity` is this rank's host identity: host_identity()
// in make_engine, made up in tests (several "hosts" in one process).
std::unique_ptr<CollectiveEngine> make_cpu_engine(std::shared_ptr<Store> store, int rank,
                                                  int world_size,
                                                  const CommunicatorOptions& options,
                                                  std::shared_ptr<StickyFailure> failure,
                                                  std::shared_ptr<WireCounter> wire,
                                                  const std::string& identity);

}  // namespace dtrain::detail

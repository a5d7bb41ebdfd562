// Setting up shared memory for one communicator: which transport its ranks use
// (make_host_transport) and how they come to map one segment (join_segment).
#pragma once

#include <memory>
#include <optional>

#include "comm/failure.h"
#include "comm/shm/segment.h"
#include "comm/transport.h"

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

// The CPU transport of a communicator. Every rank publishes its host identity (host.h) and
// the transport it asks for; all then decide alike:
//  * kGloo asked by any rank: Gloo; kGloo and kSharedMemory both asked: InvalidArgument.
//  * all ranks on one host: shared memory (kAuto falls back to Gloo, with a note on stderr,
//    if rank 0 cannot create a segment);
//  * several hosts with the same number of ranks each: hierarchical
//    (hierarchical_transport.h) when a host has two ranks or more or kSharedMemory was
//    asked, else Gloo;
//  * several hosts with different numbers of ranks: Gloo (kSharedMemory asked:
//    InvalidArgument naming two hosts).
// Point-to-point always goes through Gloo.
std::unique_ptr<detail::Transport> make_host_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure);

// The same with this rank's host identity given (tests: several "hosts" in one process).
std::unique_ptr<detail::Transport> make_host_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, const std::string& identity);

}  // namespace dtrain::shm

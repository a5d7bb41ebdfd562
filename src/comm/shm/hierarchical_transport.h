// Hierarchical transport for ranks on several hosts with the same number of ranks each:
// shared memory inside each host (one segment per host), Gloo between one leader per host
// (its lowest rank), as NCCL does. Per call:
//  * every host checks its ranks' headers through its segment, the leaders exchange theirs
//    through Gloo (equality is transitive, so all ranks agree or someone raises DesyncError;
//    a leader's DesyncError reaches its host's other ranks as "rank L failed");
//  * all_reduce: shared-memory all_reduce, leaders all_reduce, shared-memory broadcast;
//  * broadcast: on the root's host from the root, leaders from the root's leader, then on the
//    other hosts from their leader;
//  * all_gather: shared-memory all_gather of the host's block, leaders all_gather the blocks,
//    shared-memory broadcast, then blocks land at their ranks' places (hosts need not hold
//    consecutive ranks);
//  * reduce_scatter: all_reduce of a copy of the input, then this rank's slice (simple, not
//    optimal: the leaders move the whole input instead of 1/hosts of it);
//  * barrier: the host's header barrier, leaders' barrier, the host's barrier again.
// Send/recv go through a Gloo transport over all ranks.
#pragma once

#include <memory>
#include <vector>

#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/wire_counter.h"

namespace dtrain::shm {

struct HostLayout {
  std::vector<std::vector<int>> hosts;  // ranks per host, ascending; hosts by lowest rank
  int host = 0;                         // this rank's host
  int local = 0;                        // this rank's index on it
};

// Joins this host's segment (store keys under "<options.name>/host<h>") and, on leaders,
// the leaders' Gloo transport ("<options.name>/leaders"). Throws what join_segment and
// make_gloo_transport throw. Counts in `wire`: what this rank writes into its host's segment
// as intra-host, what the leaders' Gloo group sends as inter-host (one leader per host).
std::unique_ptr<detail::CollectiveEngine> make_hierarchical_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, std::shared_ptr<detail::WireCounter> wire,
    HostLayout layout, std::unique_ptr<detail::CollectiveEngine> p2p);

}  // namespace dtrain::shm

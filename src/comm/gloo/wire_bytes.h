// The bytes Gloo's own collectives send from one rank, computed from their schedules
// (Gloo 0.0~git20220518: gloo/allreduce.cc ring, gloo/allgather.cc, gloo/broadcast.cc),
// which depend only on sizes, rank and world size. dtrain cannot see inside Gloo's sends,
// so the schedule is replayed here; the collectives dtrain runs itself (its ring
// reduce-scatter, the header exchange, send/recv) count where they send. Tested against
// the closed forms in collectives_test ("WireBytes").
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace dtrain::gloo_backend {

// Gloo's ring all-reduce (reduce-scatter then all-gather, in segments of at most
// `max_segment_bytes`, rounded to whole elements): the bytes rank `rank` sends to rank
// `rank - 1`, both phases. 2 * (world - 1) / world * total_bytes when the segments divide
// evenly.
uint64_t ring_all_reduce_bytes(size_t total_bytes, size_t element_size, size_t max_segment_bytes,
                               int rank, int world);

// Gloo's ring all-gather: (world - 1) * input_bytes, all to rank + 1.
uint64_t ring_all_gather_bytes(size_t input_bytes, int world);

// Gloo's binomial-tree broadcast: the ranks `rank` sends the whole buffer to.
std::vector<int> broadcast_peers(int rank, int root, int world);

}  // namespace dtrain::gloo_backend

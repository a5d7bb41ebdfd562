// The shared-memory collectives, one per file. Every one runs in chunks of the segment's
// buffers, alternating between the two buffer sets, so a rank can copy chunk k into one set
// while slower peers still read chunk k - 1 from the other; the barrier at each chunk also
// proves that chunk k - 2's set is free again. Reductions are split across ranks: each rank
// reduces its 1/N slice of a chunk from every rank's buffer (in rank order, so every element
// is rounded the same way whoever reduces it), then ranks copy the reduced slices.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "comm/engine.h"
#include "comm/reduce/reduce_ops.h"
#include "comm/shm/barrier.h"
#include "comm/shm/segment.h"
#include "comm/wire_counter.h"

namespace dtrain::shm {

using reduce::ReduceFn;

// One call's view of the segment: which rank, which buffer set comes next, its deadline.
class Steps {
 public:
  Steps(const Segment& segment, Barrier& barrier, int rank, uint64_t& sets_used,
        Clock::time_point deadline, std::chrono::milliseconds timeout, std::string label)
      : segment_(segment),
        barrier_(barrier),
        rank_(rank),
        sets_used_(sets_used),
        deadline_(deadline),
        timeout_(timeout),
        label_(std::move(label)) {}

  const Segment& segment() const { return segment_; }
  int rank() const { return rank_; }
  int world() const { return segment_.world_size(); }
  // The buffer set of the next chunk: alternates over the communicator's lifetime.
  int next_set() { return static_cast<int>(sets_used_++ % 2); }
  // Every rank finished the previous phase of chunk `chunk`.
  void sync(size_t chunk, size_t chunks);
  // Count what this call writes into the segment in `wire`, as `kind` (the user's call).
  void count_in(const detail::WireTally& wire, detail::WireKind kind) {
    wire_ = &wire;
    kind_ = kind;
  }
  // This rank wrote `bytes` of payload into the segment for its peers to read.
  void wrote(size_t bytes) {
    if (wire_ != nullptr) wire_->shared(kind_, bytes);
  }

 private:
  const Segment& segment_;
  Barrier& barrier_;
  const int rank_;
  uint64_t& sets_used_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;
  const std::string label_;
  const detail::WireTally* wire_ = nullptr;
  detail::WireKind kind_ = detail::WireKind::kControl;
};

// The consistency check through the segment: writes this rank's header of `call`, waits at
// the call's first barrier (TimeoutError "rank(s) 2 did not issue collective #17 ..."), and
// throws DesyncError (find_mismatch) unless every rank's header agrees. Headers alternate
// between two slots, so none is rewritten before every rank compared it.
void check_headers(const Segment& segment, Barrier& barrier, int rank,
                   const detail::Collective& call, Clock::time_point deadline);

// Number of chunks of `per_chunk` elements covering `n`.
inline size_t chunk_count(size_t n, size_t per_chunk) { return (n + per_chunk - 1) / per_chunk; }

// tensor = reduction over ranks (kAvg: the sum; the caller divides).
void all_reduce(Steps& steps, const at::Tensor& tensor, ReduceFn fn);
// output[r*n, (r+1)*n) = rank r's input; input may be this rank's slice of output.
void all_gather(Steps& steps, const at::Tensor& output, const at::Tensor& input);
// output = reduction over ranks of input[rank*n, (rank+1)*n); input unchanged.
void reduce_scatter(Steps& steps, const at::Tensor& output, const at::Tensor& input, ReduceFn fn);
// tensor = root's tensor.
void broadcast(Steps& steps, const at::Tensor& tensor, int root);

}  // namespace dtrain::shm

// dtrain's ring reduce-scatter over Gloo's unbound buffers (Gloo's own ReduceScatterHalvingDoubling
// slowed later collectives on the same context about 20x; see docs/communication.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>

#include "comm/reduce/reduce_ops.h"

namespace gloo {
class Context;
}

namespace dtrain::gloo_backend {

// Chunk-sized buffers reused across calls: fresh ones on every call cost more in page faults
// than the reduction itself. One per communicator, used by one thread at a time.
class RingScratch {
 public:
  // A typed view of `numel` elements of slot 0..2, grown on demand.
  at::Tensor get(int slot, int64_t numel, const at::Tensor& like);

 private:
  at::Tensor bytes_[3];
};

// output (n elements) receives this rank's slice [rank * n, (rank + 1) * n) of the
// element-wise reduction `fn` over ranks of input (world * n elements); input is not
// modified. Messages use Gloo slot `slot` and pieces of at most max_segment_bytes; every
// wait is bounded by `timeout`. Both tensors are contiguous, of one dtype (checked by the
// caller). Divides nothing: kAvg is the caller's business.
void reduce_scatter_ring(gloo::Context& context, const at::Tensor& output, const at::Tensor& input,
                         reduce::ReduceFn fn, uint64_t slot, size_t max_segment_bytes,
                         std::chrono::milliseconds timeout, RingScratch& scratch);

}  // namespace dtrain::gloo_backend

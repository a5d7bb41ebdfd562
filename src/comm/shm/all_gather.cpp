// All-gather, per chunk: copy this rank's chunk into its buffer | sync | copy every other
// rank's chunk out. This rank's own slice is copied directly (or not at all when the input
// already is that slice, as in FSDP's in-place gather).
#include <cstring>

#include "comm/shm/algorithms.h"

namespace dtrain::shm {

void all_gather(Steps& steps, const at::Tensor& output, const at::Tensor& input) {
  const int world = steps.world();
  const int me = steps.rank();
  const size_t es = input.element_size();
  const size_t n = static_cast<size_t>(input.numel());
  const auto* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  char* own = out + static_cast<size_t>(me) * n * es;
  if (own != in && n > 0) std::memmove(own, in, n * es);
  if (world == 1 || n == 0) return;
  const size_t per_chunk = steps.segment().chunk_bytes() / es;
  const size_t chunks = chunk_count(n, per_chunk);
  for (size_t c = 0; c < chunks; ++c) {
    const size_t off = c * per_chunk;
    const size_t len = std::min(per_chunk, n - off);
    const int set = steps.next_set();
    std::memcpy(steps.segment().buffer(set, me), own + off * es, len * es);
    steps.wrote(len * es);
    steps.sync(c, chunks);
    for (int r = 0; r < world; ++r) {
      if (r == me) continue;
      std::memcpy(out + (static_cast<size_t>(r) * n + off) * es, steps.segment().buffer(set, r),
                  len * es);
    }
  }
}

}  // namespace dtrain::shm

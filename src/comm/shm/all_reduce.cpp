// All-reduce as reduce-scatter then all-gather through the segment, per chunk:
//   copy in (own buffer) | sync | reduce own slice from every buffer into the tensor, copy
//   it to own buffer | sync | copy the other ranks' reduced slices out.
#include <cstring>

#include "comm/shm/algorithms.h"

namespace dtrain::shm {

void all_reduce(Steps& steps, const at::Tensor& tensor, ReduceFn fn) {
  const int world = steps.world();
  const int me = steps.rank();
  const size_t es = tensor.element_size();
  const size_t n = static_cast<size_t>(tensor.numel());
  const size_t per_chunk = steps.segment().chunk_bytes() / es;
  const size_t chunks = chunk_count(n, per_chunk);
  char* data = static_cast<char*>(tensor.data_ptr());
  if (world == 1 || n == 0) return;
  for (size_t c = 0; c < chunks; ++c) {
    const size_t off = c * per_chunk;
    const size_t len = std::min(per_chunk, n - off);
    const int set = steps.next_set();
    auto slice_lo = [&](int r) {
      return len * static_cast<size_t>(r) / static_cast<size_t>(world);
    };
    auto buf = [&](int r) { return steps.segment().buffer(set, r); };
    std::memcpy(buf(me), data + off * es, len * es);
    steps.wrote(len * es);
    steps.sync(c, chunks);
    const size_t lo = slice_lo(me);
    const size_t hi = slice_lo(me + 1);
    if (hi > lo) {
      char* out = data + (off + lo) * es;
      fn(out, buf(0) + lo * es, buf(1) + lo * es, hi - lo);
      for (int r = 2; r < world; ++r) fn(out, out, buf(r) + lo * es, hi - lo);
      std::memcpy(buf(me) + lo * es, out, (hi - lo) * es);
      steps.wrote((hi - lo) * es);
    }
    steps.sync(c, chunks);
    for (int r = 0; r < world; ++r) {
      if (r == me) continue;
      const size_t a = slice_lo(r);
      const size_t b = slice_lo(r + 1);
      if (b > a) std::memcpy(data + (off + a) * es, buf(r) + a * es, (b - a) * es);
    }
  }
}

}  // namespace dtrain::shm

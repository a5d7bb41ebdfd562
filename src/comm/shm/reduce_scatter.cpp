// Reduce-scatter, per chunk: every rank copies, for each destination rank r, its chunk of
// input slice r into region r of its own buffer | sync | rank r reduces region r of every
// buffer into its output. One sync per chunk; the input is never written.
#include <cstring>

#include "comm/shm/algorithms.h"

namespace dtrain::shm {

void reduce_scatter(Steps& steps, const at::Tensor& output, const at::Tensor& input, ReduceFn fn) {
  const int world = steps.world();
  const int me = steps.rank();
  const size_t es = input.element_size();
  const size_t n = static_cast<size_t>(output.numel());
  const auto* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  if (world == 1) {
    if (n > 0) std::memcpy(out, in, n * es);
    return;
  }
  // Segment::create keeps chunk_bytes >= 8 * world, so every region holds an element.
  const size_t per_region = steps.segment().chunk_bytes() / static_cast<size_t>(world) / es;
  const size_t chunks = chunk_count(n, per_region);
  for (size_t c = 0; c < chunks; ++c) {
    const size_t off = c * per_region;
    const size_t len = std::min(per_region, n - off);
    const int set = steps.next_set();
    auto region = [&](int owner, int r) {
      return steps.segment().buffer(set, owner) + static_cast<size_t>(r) * per_region * es;
    };
    for (int r = 0; r < world; ++r)
      std::memcpy(region(me, r), in + (static_cast<size_t>(r) * n + off) * es, len * es);
    steps.wrote(static_cast<size_t>(world) * len * es);
    steps.sync(c, chunks);
    char* dst = out + off * es;
    fn(dst, region(0, me), region(1, me), len);
    for (int r = 2; r < world; ++r) fn(dst, dst, region(r, me), len);
  }
}

}  // namespace dtrain::shm

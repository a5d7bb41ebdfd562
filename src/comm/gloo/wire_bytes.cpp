#include "comm/gloo/wire_bytes.h"

#include <algorithm>

namespace dtrain::gloo_backend {
namespace {

size_t round_up(size_t value, size_t multiple) {
  const size_t rem = value % multiple;
  return rem == 0 ? value : value + multiple - rem;
}

}  // namespace

uint64_t ring_all_reduce_bytes(size_t total_bytes, size_t element_size, size_t max_segment_bytes,
                               int rank, int world) {
  if (world < 2 || total_bytes == 0) return 0;
  const auto n = static_cast<size_t>(world);
  const auto r = static_cast<size_t>(rank);
  // As gloo/allreduce.cc's ring(): segment count a multiple of the world size, at least two
  // per rank; segments of whole elements; the last segments may be short or empty.
  const size_t max_seg = element_size * std::max<size_t>(1, max_segment_bytes / element_size);
  const size_t segments = round_up(std::max((total_bytes + max_seg - 1) / max_seg, n * 2), n);
  const size_t per_rank = segments / n;
  const size_t seg_bytes = round_up((total_bytes + segments - 1) / segments, element_size);
  auto length = [&](size_t first_segment, size_t i) -> uint64_t {
    const size_t offset = ((first_segment + i) * seg_bytes) % (segments * seg_bytes);
    return offset >= total_bytes ? 0 : std::min(seg_bytes, total_bytes - offset);
  };
  uint64_t sent = 0;
  for (size_t i = 0; i < segments - per_rank; ++i) {
    sent += length((r + 1) * per_rank, i);  // reduce-scatter phase
    sent += length(r * per_rank, i);        // all-gather phase
  }
  return sent;
}

uint64_t ring_all_gather_bytes(size_t input_bytes, int world) {
  return world < 2 ? 0 : static_cast<uint64_t>(world - 1) * input_bytes;
}

std::vector<int> broadcast_peers(int rank, int root, int world) {
  // As gloo/broadcast.cc: virtual ranks relative to the root; in round i a rank whose low
  // bits above i are clear sends to vrank ^ (1 << i) if its own bit i is clear.
  std::vector<int> peers;
  const auto vsize = static_cast<size_t>(world);
  const size_t vrank = (static_cast<size_t>(rank) + vsize - static_cast<size_t>(root)) % vsize;
  size_t dim = 0;
  while ((size_t{1} << dim) < vsize) ++dim;
  size_t mask = (size_t{1} << dim) - 1;
  for (size_t i = 0; i < dim; ++i) {
    mask ^= size_t{1} << i;
    if ((vrank & mask) != 0) continue;
    const size_t vpeer = vrank ^ (size_t{1} << i);
    if (vpeer >= vsize) continue;
    if ((vrank & (size_t{1} << i)) == 0) {
      peers.push_back(static_cast<int>((vpeer + static_cast<size_t>(root)) % vsize));
    }
  }
  return peers;
}

}  // namespace dtrain::gloo_backend

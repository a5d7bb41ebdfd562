// Broadcast, per chunk: the root copies a chunk into the whole buffer set (every rank's
// buffer of the set, contiguous) | sync | the others copy it out.
#include <cstring>

#include "comm/shm/algorithms.h"

namespace dtrain::shm {

void broadcast(Steps& steps, const at::Tensor& tensor, int root) {
  const int world = steps.world();
  const size_t es = tensor.element_size();
  const size_t n = static_cast<size_t>(tensor.numel());
  char* data = static_cast<char*>(tensor.data_ptr());
  if (world == 1 || n == 0) return;
  const size_t per_chunk = steps.segment().chunk_bytes() * static_cast<size_t>(world) / es;
  const size_t chunks = chunk_count(n, per_chunk);
  for (size_t c = 0; c < chunks; ++c) {
    const size_t off = c * per_chunk;
    const size_t len = std::min(per_chunk, n - off);
    char* set = steps.segment().buffer(steps.next_set(), 0);
    if (steps.rank() == root) {
      std::memcpy(set, data + off * es, len * es);
      steps.wrote(len * es);
    }
    steps.sync(c, chunks);
    if (steps.rank() != root) std::memcpy(data + off * es, set, len * es);
  }
}

}  // namespace dtrain::shm

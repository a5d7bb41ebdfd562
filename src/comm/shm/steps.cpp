#include <fmt/format.h>

#include "comm/shm/algorithms.h"

namespace dtrain::shm {

void Steps::sync(size_t chunk, size_t chunks) {
  barrier_.arrive_and_wait(deadline_, timeout_,
                           fmt::format("reach chunk {}/{} of {}", chunk + 1, chunks, label_));
}

}  // namespace dtrain::shm

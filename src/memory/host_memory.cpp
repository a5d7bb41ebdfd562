#include "dtrain/host_memory.h"

#include <malloc.h>

#include <climits>

namespace dtrain {

bool tune_host_memory(const HostMemoryTuning& tuning) {
  if (tuning.mmap_threshold > static_cast<size_t>(INT_MAX) ||
      tuning.trim_threshold > static_cast<size_t>(INT_MAX)) {
    return false;
  }
  // mallopt returns 1 on success.
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, static_cast<int>(tuning.mmap_threshold)) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, static_cast<int>(tuning.trim_threshold)) == 1;
  return mmap_ok && trim_ok;
}

}  // namespace dtrain

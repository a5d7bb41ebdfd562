// Host memory that goes back to the system. glibc's malloc keeps freed memory of large
// blocks in its heap (its mmap threshold grows with every large free, up to 32 MiB), so a
// process that frees and refills tensors every step, as FSDP does with its units, keeps its
// peak in its resident set. Serving large blocks with mmap and trimming the heap returns it.
//
// Measured with gpt2_train at 4 ranks (8 layers, dim 512, ctx 64, batch 2): peak RSS per rank
// DDP 1422 -> 1278 MiB, FSDP 1073 -> 842 MiB (docs/benchmarks.md, "Host memory").
#pragma once

#include <cstddef>

namespace dtrain {

struct HostMemoryTuning {
  // Blocks of at least this size come from mmap and go back to the system when freed (glibc's
  // M_MMAP_THRESHOLD; setting it also stops glibc from raising it on its own).
  size_t mmap_threshold = 64 << 10;
  // Free memory at the top of the heap beyond this is returned (M_TRIM_THRESHOLD).
  size_t trim_threshold = 128 << 10;
};

// Applies `tuning` to this process's glibc malloc (mallopt). Call once at start-up, before
// large allocations. Returns false when glibc refused a setting (or another allocator, such
// as a preloaded jemalloc, serves malloc: the call then changes nothing).
bool tune_host_memory(const HostMemoryTuning& tuning = {});

}  // namespace dtrain

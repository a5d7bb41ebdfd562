// Host memory that goes back to the system, and comes from it cheaply.
//
// glibc's malloc keeps freed memory of large blocks in its heap (its mmap threshold grows with
// every large free, up to 32 MiB), so a process that frees and refills tensors every step, as
// FSDP does with its units, keeps its peak in its resident set. Serving large blocks with mmap
// and trimming the heap returns it. But memory fresh from the system is paid for in page
// faults on first touch, one per 4 KiB page: on the VM of docs/benchmarks-history.md ("Host
// memory") first touch ran at 0.19 GB/s against 10 GB/s for memory already mapped, and the
// GPT-2 tiny trainer ran 3.3x slower with every block >= 64 KiB from mmap. Transparent huge
// pages (2 MiB) cut the faults 512-fold. So dtrain tunes both:
//   - in-process (tune_host_memory): blocks >= 4 MiB come from mmap, the heap is trimmed
//     beyond 4 MiB of free top;
//   - at process start (host_memory_environment): glibc's malloc advises transparent huge
//     pages for its heap and mmapped blocks (GLIBC_TUNABLES glibc.malloc.hugetlb=1, glibc
//     >= 2.35; glibc reads it only when a process starts, so launchers set it for the
//     processes they start and gpt2_train restarts itself with it).
#pragma once

#include <cstddef>
#include <map>
#include <string>

namespace dtrain {

struct HostMemoryTuning {
  // Blocks of at least this size come from mmap and go back to the system when freed (glibc's
  // M_MMAP_THRESHOLD; setting it also stops glibc from raising it on its own). Below 2 MiB,
  // blocks cannot use huge pages and every step faults their pages in again.
  size_t mmap_threshold = 4 << 20;
  // Free memory at the top of the heap beyond this is returned (M_TRIM_THRESHOLD).
  size_t trim_threshold = 4 << 20;
  // Ask for transparent huge pages on malloc's memory (host_memory_environment). Has an
  // effect where the kernel's THP mode is "madvise" (with "always" every process gets them,
  // with "never" none does).
  bool huge_pages = true;
};

// Applies `tuning`'s thresholds to this process's glibc malloc (mallopt). Call once at
// start-up, before large allocations. Returns false when glibc refused a setting (or another
// allocator, such as a preloaded jemalloc, serves malloc: the call then changes nothing).
bool tune_host_memory(const HostMemoryTuning& tuning = {});

// The variable glibc reads its malloc tunables from, at process start.
inline constexpr const char* kGlibcTunablesEnv = "GLIBC_TUNABLES";

// Variables to set in the environment of processes started from here so that their malloc
// uses huge pages: GLIBC_TUNABLES with glibc.malloc.hugetlb=1 appended to what `env` has.
// Empty when tuning.huge_pages is false or `env`'s GLIBC_TUNABLES already sets
// glibc.malloc.hugetlb (a user's choice is never overridden). Pure: `env` holds at least
// GLIBC_TUNABLES when set (host_memory_environment_from_env()).
std::map<std::string, std::string> host_memory_environment(
    const std::map<std::string, std::string>& env, const HostMemoryTuning& tuning = {});

// The variables host_memory_environment() looks at, as this process's environment has them.
std::map<std::string, std::string> host_memory_environment_from_env();

// Whether this process's malloc was started with huge pages requested (its GLIBC_TUNABLES
// sets glibc.malloc.hugetlb to a non-zero value), for run headers.
bool malloc_huge_pages_requested();

}  // namespace dtrain

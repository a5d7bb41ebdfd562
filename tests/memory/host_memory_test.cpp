// tune_host_memory: once applied, a new block above the threshold (4 MiB) is served by mmap (so
// freeing it returns it to the system) where glibc's dynamic threshold would have grown the
// heap. host_memory_environment: huge pages are requested without overriding a user's choice.
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "dtrain/host_memory.h"

namespace dtrain {
namespace {

// Whether a new block of `bytes` comes from mmap. Callers pass a size larger than any block
// freed so far, so no free chunk in the heap can serve it.
bool new_block_is_mmapped(size_t bytes) {
  malloc_trim(0);
  const size_t before = mallinfo2().hblks;
  // volatile: the compiler may otherwise drop a malloc/free pair whose block is unused.
  void* volatile p = std::malloc(bytes);
  const bool mapped = mallinfo2().hblks == before + 1;
  std::free(p);
  return mapped;
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kGlibcMalloc = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kGlibcMalloc = false;
#else
constexpr bool kGlibcMalloc = true;
#endif
#else
constexpr bool kGlibcMalloc = true;
#endif

TEST(HostMemory, BlocksAboveTheThresholdComeFromMmapAfterTuning) {
  if (!kGlibcMalloc) GTEST_SKIP() << "a sanitizer's allocator serves malloc, not glibc's";
  // Freeing a large mmapped block raises glibc's dynamic threshold past it (here 8 MiB), so
  // without tuning a 2 MiB block then grows the heap and stays there when freed.
  void* volatile big = std::malloc(8 << 20);
  std::memset(big, 1, 8 << 20);
  std::free(big);
  EXPECT_FALSE(new_block_is_mmapped(2 << 20));
  ASSERT_TRUE(tune_host_memory());
  EXPECT_FALSE(new_block_is_mmapped(2 << 20));  // below the tuned threshold: the heap
  EXPECT_TRUE(new_block_is_mmapped(5 << 20));
}

TEST(HostMemory, ThresholdsBeyondGlibcsRangeAreRefused) {
  HostMemoryTuning t;
  t.mmap_threshold = size_t{1} << 40;
  EXPECT_FALSE(tune_host_memory(t));
}

using Env = std::map<std::string, std::string>;

TEST(HostMemory, HugePagesAreRequestedThroughGlibcTunables) {
  EXPECT_EQ(host_memory_environment({}), (Env{{"GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"}}));
  // Other tunables of the user's stay, ours is appended.
  EXPECT_EQ(host_memory_environment({{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2"}}),
            (Env{{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}}));
  EXPECT_EQ(host_memory_environment({{"GLIBC_TUNABLES", ""}}),
            (Env{{"GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"}}));
}

TEST(HostMemory, AUsersHugetlbChoiceIsNeverOverridden) {
  EXPECT_TRUE(host_memory_environment({{"GLIBC_TUNABLES", "glibc.malloc.hugetlb=0"}}).empty());
  EXPECT_TRUE(host_memory_environment(
                  {{"GLIBC_TUNABLES", "glibc.malloc.hugetlb=2:glibc.malloc.arena_max=2"}})
                  .empty());
  // A tunable whose name merely starts the same is not the user's choice.
  EXPECT_EQ(host_memory_environment({{"GLIBC_TUNABLES", "glibc.malloc.hugetlbx=0"}}),
            (Env{{"GLIBC_TUNABLES", "glibc.malloc.hugetlbx=0:glibc.malloc.hugetlb=1"}}));
}

TEST(HostMemory, HugePagesOffRequestsNothing) {
  HostMemoryTuning t;
  t.huge_pages = false;
  EXPECT_TRUE(host_memory_environment({}, t).empty());
}

}  // namespace
}  // namespace dtrain

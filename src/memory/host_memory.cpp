#include "dtrain/host_memory.h"

#include <malloc.h>

#include <climits>
#include <cstdlib>
#include <sstream>

namespace dtrain {
namespace {

constexpr const char* kHugetlbTunable = "glibc.malloc.hugetlb";

// Whether GLIBC_TUNABLES ("name=value:name=value...") sets `name`, and to what (glibc uses the
// last occurrence).
bool find_tunable(const std::string& tunables, const std::string& name, std::string* value) {
  bool found = false;
  std::istringstream in(tunables);
  for (std::string item; std::getline(in, item, ':');) {
    const auto eq = item.find('=');
    if (eq != std::string::npos && item.compare(0, eq, name) == 0) {
      *value = item.substr(eq + 1);
      found = true;
    }
  }
  return found;
}

}  // namespace

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

std::map<std::string, std::string> host_memory_environment(
    const std::map<std::string, std::string>& env, const HostMemoryTuning& tuning) {
  if (!tuning.huge_pages) return {};
  const auto it = env.find(kGlibcTunablesEnv);
  const std::string current = it == env.end() ? std::string() : it->second;
  std::string ignored;
  if (find_tunable(current, kHugetlbTunable, &ignored)) return {};
  const std::string ours = std::string(kHugetlbTunable) + "=1";
  return {{kGlibcTunablesEnv, current.empty() ? ours : current + ":" + ours}};
}

std::map<std::string, std::string> host_memory_environment_from_env() {
  std::map<std::string, std::string> env;
  if (const char* value = std::getenv(kGlibcTunablesEnv)) env[kGlibcTunablesEnv] = value;
  return env;
}

bool malloc_huge_pages_requested() {
  const char* tunables = std::getenv(kGlibcTunablesEnv);
  std::string value;
  return tunables != nullptr && find_tunable(tunables, kHugetlbTunable, &value) && !value.empty() &&
         value != "0";
}

}  // namespace dtrain

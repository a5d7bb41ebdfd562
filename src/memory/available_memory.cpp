// How much memory this machine offers a rank: /proc/meminfo's MemAvailable and the memory
// cgroup's limit (the planner's default budget on the CPU, dtrain/memory_plan.h).
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/memory_plan.h"

namespace dtrain {
namespace {

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712);
// anything above 2^60 bytes is no limit in practice.
constexpr int64_t kNoLimit = int64_t{1} << 60;

// This process's cgroup paths from /proc/self/cgroup: the v2 one ("0::/path") and the v1
// memory controller's ("N:...memory...:/path").
struct CgroupPaths {
  std::optional<std::string> v2, v1_memory;
};

CgroupPaths own_cgroups() {
  CgroupPaths out;
  const auto text = read_text("/proc/self/cgroup");
  if (!text) return out;
  std::istringstream in(*text);
  for (std::string line; std::getline(in, line);) {
    const auto a = line.find(':');
    const auto b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) out.v2 = path;
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name == "memory") out.v1_memory = path;
    }
  }
  return out;
}

// The first limit found among `files` (the process's own cgroup, then the mount's root,
// which is the own cgroup inside a cgroup namespace).
std::optional<int64_t> first_limit(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    if (auto text = read_text(f)) return parse_cgroup_limit(*text);
  }
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> parse_meminfo_available(const std::string& meminfo) {
  std::istringstream in(meminfo);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t kib = -1;
    std::string unit;
    if (!(fields >> kib) || kib < 0) return std::nullopt;
    fields >> unit;
    if (!unit.empty() && unit != "kB") return std::nullopt;
    return kib * 1024;
  }
  return std::nullopt;
}

std::optional<int64_t> parse_cgroup_limit(const std::string& text) {
  std::string t = text;
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  if (t.empty() || t == "max") return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(t.c_str(), &end, 10);
  if (errno != 0 || end != t.c_str() + t.size() || t[0] == '-') return std::nullopt;
  if (v >= static_cast<unsigned long long>(kNoLimit)) return std::nullopt;
  return static_cast<int64_t>(v);
}

std::optional<int64_t> HostMemoryInfo::available() const {
  if (mem_available && cgroup_limit) return std::min(*mem_available, *cgroup_limit);
  if (mem_available) return mem_available;
  return cgroup_limit;
}

std::string HostMemoryInfo::to_string() const {
  std::string out = mem_available ? "MemAvailable " + format_gib(*mem_available)
                                  : std::string("MemAvailable unknown");
  out += cgroup_limit ? ", cgroup limit " + format_gib(*cgroup_limit)
                      : std::string(", no cgroup limit");
  return out;
}

HostMemoryInfo read_host_memory() {
  HostMemoryInfo info;
  if (auto text = read_text("/proc/meminfo")) info.mem_available = parse_meminfo_available(*text);
  const CgroupPaths own = own_cgroups();
  std::vector<std::string> files;
  if (own.v2) files.push_back("/sys/fs/cgroup" + *own.v2 + "/memory.max");
  if (own.v1_memory) {
    files.push_back("/sys/fs/cgroup/memory" + *own.v1_memory + "/memory.limit_in_bytes");
  }
  files.push_back("/sys/fs/cgroup/memory.max");
  files.push_back("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  info.cgroup_limit = first_limit(files);
  return info;
}

std::optional<int64_t> default_memory_per_rank(int local_ranks) {
  const auto available = read_host_memory().available();
  if (!available) return std::nullopt;
  return *available / std::max(1, local_ranks);
}

}  // namespace dtrain

#include "comm/shm/host.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace dtrain::shm {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Identifies a namespace (or file system) by device and inode; "?" if unreadable, which
// then only matches another "?" — both ranks lacking /proc still share a host only if
// every other part agrees.
std::string inode_of(const char* path) {
  struct stat st {};
  if (stat(path, &st) != 0) return "?";
  return fmt::format("{}:{}", static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
}

struct StatFields {
  bool ok = false;
  char state = '?';
  uint64_t start_time = 0;
};

// /proc/<pid>/stat: "pid (comm) S ppid ... starttime(22) ..."; comm may hold spaces and
// parentheses, so parsing starts after the last ')'.
StatFields read_stat(int32_t pid) {
  StatFields f;
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return f;
  std::istringstream rest(text.substr(close + 1));
  std::string tok;
  for (int field = 3; rest >> tok && field <= 22; ++field) {
    if (field == 3) f.state = tok.empty() ? '?' : tok[0];
    if (field == 22) {
      f.start_time = std::strtoull(tok.c_str(), nullptr, 10);
      f.ok = true;
    }
  }
  return f;
}

}  // namespace

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

std::string host_identity() {
  return fmt::format("{} boot={} shm={} ipc={} pid={} net={}", host_name(),
                     read_line("/proc/sys/kernel/random/boot_id"), inode_of("/dev/shm"),
                     inode_of("/proc/self/ns/ipc"), inode_of("/proc/self/ns/pid"),
                     inode_of("/proc/self/ns/net"));
}

ProcessId this_process() {
  ProcessId p;
  p.pid = static_cast<int32_t>(getpid());
  const StatFields f = read_stat(p.pid);
  p.start_time = f.ok ? f.start_time : 0;
  return p;
}

bool process_alive(const ProcessId& p) {
  if (p.pid <= 0) return false;
  const StatFields f = read_stat(p.pid);
  if (f.ok) {
    if (f.state == 'Z' || f.state == 'X') return false;
    return p.start_time == 0 || f.start_time == p.start_time;
  }
  // No /proc entry: gone, unless /proc is not mounted at all.
  return !(kill(p.pid, 0) != 0 && errno == ESRCH);
}

}  // namespace dtrain::shm

// The launcher's side of launcher/supervisor.h: finding dtrain-supervise and starting a
// rank under it.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "launcher/supervisor.h"

namespace dtrain::launcher {
namespace {

constexpr const char* kSupervisorName = "dtrain-supervise";

bool executable(const std::string& path) {
  std::error_code ec;
  return !path.empty() && std::filesystem::is_regular_file(path, ec) &&
         access(path.c_str(), X_OK) == 0;
}

// Everything the supervisor writes to its report pipe until it closes it, or until
// `deadline`; "" if it wrote nothing.
std::string read_report(int fd, std::chrono::steady_clock::time_point deadline, bool& timed_out) {
  std::string text;
  char buffer[512];
  timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      return text;
    }
    pollfd p{fd, POLLIN, 0};
    const int rc = poll(&p, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) continue;  // the deadline is checked above
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return text;
    text.append(buffer, static_cast<size_t>(n));
  }
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
  return fmt::format("ended with wait status {}", status);
}

}  // namespace

std::string find_supervisor(const std::string& configured) {
  if (!configured.empty()) {
    if (executable(configured)) return configured;
    throw std::runtime_error(
        fmt::format("the rank supervisor '{}' (NodeOptions::supervisor) is not an executable file",
                    configured));
  }
  std::vector<std::string> tried;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) tried.push_back((self.parent_path() / kSupervisorName).string());
#ifdef DTRAIN_SUPERVISOR_INSTALL_PATH
  tried.emplace_back(DTRAIN_SUPERVISOR_INSTALL_PATH);
#endif
#ifdef DTRAIN_SUPERVISOR_BUILD_PATH
  tried.emplace_back(DTRAIN_SUPERVISOR_BUILD_PATH);
#endif
  for (const auto& path : tried) {
    if (executable(path)) return path;
  }
  std::string places;
  for (const auto& path : tried) places += (places.empty() ? "" : ", ") + path;
  throw std::runtime_error(fmt::format(
      "cannot find {}, which supervises every rank (tried {}); it is built and installed with "
      "dtrain-run, or set NodeOptions::supervisor",
      kSupervisorName, places));
}

SupervisedRank spawn_supervised(const std::string& supervisor, const std::vector<std::string>& argv,
                                const std::vector<std::string>& env, SpawnOptions options) {
  if (argv.empty() || argv[0].empty()) throw std::invalid_argument("no command to run");
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  }
  options.own_process_group = true;
  options.block_signals = true;
  options.parent_death_signal = kKillTreeSignal;
  options.pass_fd = fds[1];
  std::vector<std::string> command{supervisor, std::to_string(getpid()), "--"};
  command.insert(command.end(), argv.begin(), argv.end());
  SupervisedRank started;
  try {
    started.supervisor = spawn_process(supervisor, command, env, options);
  } catch (...) {
    close(fds[0]);
    close(fds[1]);
    throw;
  }
  close(fds[1]);  // so that the supervisor's close (or death) is an end of file here
  bool timed_out = false;
  const std::string report =
      read_report(fds[0], std::chrono::steady_clock::now() + std::chrono::seconds(60), timed_out);
  close(fds[0]);
  const std::string started_tag = "started ", failed_tag = "failed ";
  if (!timed_out && report.compare(0, started_tag.size(), started_tag) == 0) {
    started.rank = static_cast<pid_t>(std::atol(report.c_str() + started_tag.size()));
    if (started.rank > 0) return started;
  }
  const bool failed = !timed_out && report.compare(0, failed_tag.size(), failed_tag) == 0;
  // A supervisor that failed has exited; one that is stuck, or said something else, is
  // stopped with whatever it may have started.
  if (!failed) kill(started.supervisor, timed_out ? SIGKILL : kKillTreeSignal);
  int status = 0;
  while (waitpid(started.supervisor, &status, 0) < 0 && errno == EINTR) {
  }
  if (failed) {
    std::string why = report.substr(failed_tag.size());
    while (!why.empty() && why.back() == '\n') why.pop_back();
    throw std::runtime_error(why);
  }
  throw std::runtime_error(fmt::format(
      "cannot start '{}': its supervisor {} (pid {}) {} ({})", argv[0], supervisor,
      started.supervisor,
      timed_out ? "did not report within 60 s and was killed" : "ended without reporting",
      report.empty() ? describe_status(status) : "it said: " + report));
}

}  // namespace dtrain::launcher

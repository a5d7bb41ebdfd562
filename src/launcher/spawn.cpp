#include "launcher/spawn.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "dtrain/launcher.h"

extern char** environ;

namespace dtrain::launcher {
namespace {

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> p;
  for (auto& s : strings) p.push_back(s.data());
  p.push_back(nullptr);
  return p;
}

// What a child that could not exec reports through its close-on-exec pipe.
struct SpawnFailure {
  enum Step : int { kExec, kStdout, kStderr, kStdin, kProcessGroup, kDeathSignal, kPassFd } step;
  int error;
};

// The child between fork and exec: async-signal-safe calls only (no allocation, no locks).
[[noreturn]] void exec_child(const char* program, char* const* argv, char* const* envp,
                             const SpawnOptions& o, pid_t parent, int report_fd) {
  const auto fail = [&](SpawnFailure::Step step) {
    const SpawnFailure f{step, errno};
    ssize_t unused = write(report_fd, &f, sizeof(f));
    (void)unused;
    _exit(127);
  };
  if (o.own_process_group && setpgid(0, 0) != 0) fail(SpawnFailure::kProcessGroup);
  if (o.parent_death_signal != 0) {
    if (prctl(PR_SET_PDEATHSIG, o.parent_death_signal) != 0) fail(SpawnFailure::kDeathSignal);
    // The parent may have died before prctl: then nobody would ever send the signal.
    if (getppid() != parent) {
      raise(o.parent_death_signal);
      _exit(128 + o.parent_death_signal);
    }
  }
  // Before the redirections, whose open() could otherwise take descriptor kPassedFd. dup2
  // clears close-on-exec on the copy; a descriptor already in place needs it cleared.
  if (o.pass_fd >= 0) {
    const int rc =
        o.pass_fd == kPassedFd ? fcntl(kPassedFd, F_SETFD, 0) : dup2(o.pass_fd, kPassedFd);
    if (rc < 0) fail(SpawnFailure::kPassFd);
  }
  const int flags = O_WRONLY | O_CREAT | O_TRUNC;
  if (!o.stdout_path.empty()) {
    const int fd = open(o.stdout_path.c_str(), flags, 0644);
    if (fd < 0 || dup2(fd, 1) < 0) fail(SpawnFailure::kStdout);
    if (fd != 1) close(fd);
  }
  if (!o.stderr_path.empty() && o.stderr_path == o.stdout_path) {
    if (dup2(1, 2) < 0) fail(SpawnFailure::kStderr);
  } else if (!o.stderr_path.empty()) {
    const int fd = open(o.stderr_path.c_str(), flags, 0644);
    if (fd < 0 || dup2(fd, 2) < 0) fail(SpawnFailure::kStderr);
    if (fd != 2) close(fd);
  }
  if (o.null_stdin) {
    const int fd = open("/dev/null", O_RDONLY);
    if (fd < 0 || dup2(fd, 0) < 0) fail(SpawnFailure::kStdin);
    if (fd != 0) close(fd);
  }
  // Handlers inherited from the parent must not run here once signals are unblocked; exec
  // resets them anyway. The stop signals start at their defaults even if ignored here.
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction old {};
    if (sigaction(sig, nullptr, &old) != 0) continue;
    const bool stop = sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT;
    if (stop || (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN)) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(sig, &dfl, nullptr);
    }
  }
  // With block_signals the mask stays as the parent blocked it across fork: everything.
  if (!o.block_signals) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
  }
  // glibc's execvpe searches PATH with stack buffers only, as posix_spawnp's child does.
  execvpe(program, argv, envp);
  fail(SpawnFailure::kExec);
  _exit(127);  // not reached: fail() exits
}

std::string describe(const SpawnFailure& f, const std::string& program, const SpawnOptions& o) {
  const char* why = std::strerror(f.error);
  switch (f.step) {
    case SpawnFailure::kExec:
      return fmt::format("cannot start '{}': {}", program, why);
    case SpawnFailure::kStdout:
      return fmt::format("cannot start '{}': cannot open {} for its stdout: {}", program,
                         o.stdout_path, why);
    case SpawnFailure::kStderr:
      return fmt::format("cannot start '{}': cannot open {} for its stderr: {}", program,
                         o.stderr_path, why);
    case SpawnFailure::kStdin:
      return fmt::format("cannot start '{}': cannot open /dev/null for its stdin: {}", program,
                         why);
    case SpawnFailure::kProcessGroup:
      return fmt::format("cannot start '{}': setpgid: {}", program, why);
    case SpawnFailure::kDeathSignal:
      return fmt::format("cannot start '{}': prctl(PR_SET_PDEATHSIG): {}", program, why);
    case SpawnFailure::kPassFd:
      return fmt::format("cannot start '{}': dup2 of descriptor {} to {}: {}", program, o.pass_fd,
                         kPassedFd, why);
  }
  return fmt::format("cannot start '{}': {}", program, why);
}

// A pipe whose ends are close-on-exec and above stdin/stdout/stderr and kPassedFd, so the
// child's redirections and dup2 cannot overwrite them.
void report_pipe(int fds[2]) {
  int raw[2];
  if (pipe2(raw, O_CLOEXEC) != 0) {
    throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  }
  for (int i = 0; i < 2; ++i) {
    fds[i] = raw[i] > kPassedFd ? raw[i] : fcntl(raw[i], F_DUPFD_CLOEXEC, kPassedFd + 1);
    if (fds[i] != raw[i]) close(raw[i]);
  }
  if (fds[0] < 0 || fds[1] < 0) {
    const int error = errno;
    if (fds[0] >= 0) close(fds[0]);
    if (fds[1] >= 0) close(fds[1]);
    throw std::runtime_error(fmt::format("pipe: {}", std::strerror(error)));
  }
}

}  // namespace

std::vector<std::string> environment_with(const std::map<std::string, std::string>& overrides,
                                          const std::set<std::string>& remove) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (remove.count(key) == 0 && overrides.count(key) == 0) env.push_back(std::move(kv));
  }
  for (const auto& [k, v] : overrides) env.push_back(k + "=" + v);
  return env;
}

pid_t spawn_process(const std::string& program, const std::vector<std::string>& argv,
                    const std::vector<std::string>& env, const SpawnOptions& options) {
  // Everything the child needs is prepared here: it must not allocate.
  std::vector<std::string> args = argv, envs = env;
  std::vector<char*> argp = pointers(args), envp = pointers(envs);
  int report[2];
  report_pipe(report);
  const pid_t parent = getpid();
  // Blocked across fork so that no handler of this process runs in the child before exec.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = fork();
  if (pid == 0) {
    close(report[0]);
    exec_child(program.c_str(), argp.data(), envp.data(), options, parent, report[1]);
  }
  const int fork_error = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  close(report[1]);
  if (pid < 0) {
    close(report[0]);
    throw std::runtime_error(
        fmt::format("cannot start '{}': fork: {}", program, std::strerror(fork_error)));
  }
  // EOF once exec succeeded (the pipe closes on exec); a SpawnFailure otherwise.
  SpawnFailure failure{};
  ssize_t n;
  do {
    n = read(report[0], &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n == 0) return pid;
  while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  if (n != static_cast<ssize_t>(sizeof(failure))) {
    throw std::runtime_error(fmt::format("cannot start '{}': lost its start report", program));
  }
  throw std::runtime_error(describe(failure, program, options));
}

pid_t spawn_process(const std::string& program, const std::vector<std::string>& argv,
                    const std::vector<std::string>& env, const std::string& stdout_path,
                    const std::string& stderr_path) {
  SpawnOptions options;
  options.stdout_path = stdout_path;
  options.stderr_path = stderr_path;
  return spawn_process(program, argv, env, options);
}

int free_port() {
  // Scan below the kernel's ephemeral range (32768+ on Linux): a port in that range can be
  // handed out as the source port of any outgoing connection between this check and the
  // store server's bind. Start at a per-process offset so concurrent jobs rarely collide.
  static std::atomic<int> next{static_cast<int>(getpid() % 6000) * 2};
  for (int attempt = 0; attempt < 12000; ++attempt) {
    const int port = 20000 + next.fetch_add(1) % 12000;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw std::runtime_error(fmt::format("socket: {}", std::strerror(errno)));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (ok) return port;
  }
  throw std::runtime_error("no free port in [20000, 32000)");
}

}  // namespace dtrain::launcher

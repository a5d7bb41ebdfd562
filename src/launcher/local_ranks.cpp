#include "launcher/local_ranks.h"

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
#include <set>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

extern char** environ;

namespace dtrain::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// A signal handler can reach only static storage; these are written by on_signal and read
// (then reset) by run_node's loop on the same thread.
volatile sig_atomic_t g_pending_signal = 0;
volatile sig_atomic_t g_signal_count = 0;

void on_signal(int sig) {
  g_pending_signal = sig;
  g_signal_count = g_signal_count + 1;
}

// The signals that stop the job.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGKILL:
      return "SIGKILL";
    default:
      return strsignal(sig);
  }
}

// Installs on_signal for the stop signals while alive; restores the old handlers after. A
// SIGHUP ignored on entry (nohup) stays ignored: surviving a hangup is what the user asked.
// SIGCHLD is at its default meanwhile: ignored, the kernel would reap the ranks itself and
// their exit statuses would be lost.
class SignalForwarding {
 public:
  SignalForwarding() {
    g_pending_signal = 0;
    g_signal_count = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kStopSignals); ++i) {
      const int sig = kStopSignals[i];
      sigaction(sig, nullptr, &old_[i]);
      if (sig == SIGHUP && old_[i].sa_handler == SIG_IGN) continue;
      sigaction(sig, &sa, nullptr);
    }
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGCHLD, &dfl, &old_chld_);
  }
  ~SignalForwarding() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i) {
      sigaction(kStopSignals[i], &old_[i], nullptr);
    }
    sigaction(SIGCHLD, &old_chld_, nullptr);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  struct sigaction old_[std::size(kStopSignals)]{};
  struct sigaction old_chld_ {};
};

struct Child {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;  // also its process group id
  bool running = false;
  int status = 0;
};

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return fmt::format("was killed by signal {} ({})", sig, strsignal(sig));
  }
  return fmt::format("ended with wait status {}", status);
}

bool failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

int exit_status_for(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> p;
  for (auto& s : strings) p.push_back(s.data());
  p.push_back(nullptr);
  return p;
}

pid_t spawn(const NodeOptions& o, int local_rank, int port, bool null_stdin) {
  std::map<std::string, std::string> vars = {
      {"RANK", std::to_string(o.node_rank * o.nproc_per_node + local_rank)},
      {"WORLD_SIZE", std::to_string(o.nnodes * o.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(port)}};
  vars.insert(o.environment.begin(), o.environment.end());  // keeps the rank variables
  const std::vector<std::string> env = environment_with(vars);
  SpawnOptions so;
  so.own_process_group = true;
  so.parent_death_signal = SIGKILL;
  so.null_stdin = null_stdin;
  try {
    return spawn_process(o.argv[0], o.argv, env, so);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: local rank {}: {}", o.name, local_rank, e.what()));
  }
}

// What a child that could not exec reports through its close-on-exec pipe.
struct SpawnFailure {
  enum Step : int { kExec, kStdout, kStderr, kStdin, kProcessGroup, kDeathSignal } step;
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
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
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
  }
  return fmt::format("cannot start '{}': {}", program, why);
}

// A pipe whose ends are close-on-exec and above stdin/stdout/stderr, so the child's
// redirections cannot overwrite them.
void report_pipe(int fds[2]) {
  int raw[2];
  if (pipe2(raw, O_CLOEXEC) != 0) {
    throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  }
  for (int i = 0; i < 2; ++i) {
    fds[i] = raw[i] > 2 ? raw[i] : fcntl(raw[i], F_DUPFD_CLOEXEC, 3);
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

namespace {

// Signals the process group of every rank whose leader has not been reaped: while it has
// not, the group id cannot belong to anyone else.
void signal_running(const std::vector<Child>& children, int sig) {
  for (const auto& c : children) {
    if (c.running) kill(-c.pid, sig);
  }
}

enum class Reap { kRunning, kEnded, kWaitFailed };

// Reaps `c` if its leader ended. What the rank left in its group is SIGKILLed first, while
// the unreaped leader still holds the group id.
Reap reap(Child& c, int& wait_error) {
  siginfo_t info{};
  int rc;
  do {
    rc = waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT);
  } while (rc < 0 && errno == EINTR);
  if (rc == 0 && info.si_pid == 0) return Reap::kRunning;
  if (rc == 0) {
    kill(-c.pid, SIGKILL);
    pid_t w;
    do {
      w = waitpid(c.pid, &c.status, 0);
    } while (w < 0 && errno == EINTR);
    if (w == c.pid) return Reap::kEnded;
    rc = -1;
  }
  wait_error = errno;
  return Reap::kWaitFailed;
}

}  // namespace

void validate(const NodeOptions& o) {
  if (o.argv.empty() || o.argv[0].empty()) throw std::invalid_argument("no command to run");
  if (o.nproc_per_node < 1) throw std::invalid_argument("nproc_per_node must be at least 1");
  if (o.nnodes < 1) throw std::invalid_argument("nnodes must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw std::invalid_argument(
        fmt::format("node_rank {} is not in [0, nnodes={})", o.node_rank, o.nnodes));
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    throw std::invalid_argument(fmt::format("master_port {} is out of range", o.master_port));
  }
  if (o.master_port == 0 && o.nnodes > 1) {
    throw std::invalid_argument("a job of several nodes needs an explicit master_port");
  }
  if (o.master_addr.empty()) throw std::invalid_argument("master_addr is empty");
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

int run_node(const NodeOptions& o) {
  validate(o);
  const int port = o.master_port != 0 ? o.master_port : free_port();
  SignalForwarding forwarding;
  const bool null_stdin = isatty(0) == 1;

  std::vector<Child> children;
  for (int l = 0; l < o.nproc_per_node; ++l) {
    Child c;
    c.local_rank = l;
    c.rank = o.node_rank * o.nproc_per_node + l;
    try {
      c.pid = spawn(o, l, port, null_stdin);
    } catch (...) {
      signal_running(children, SIGKILL);
      for (const auto& s : children) {
        while (waitpid(s.pid, nullptr, 0) < 0 && errno == EINTR) {
        }
      }
      throw;
    }
    c.running = true;
    children.push_back(c);
  }

  int result = 0;
  bool stopping = false, killed = false;
  int received = 0;  // the stop signal that arrived first
  Clock::time_point deadline{};
  auto stop_others = [&] {
    stopping = true;
    deadline = Clock::now() + o.grace;
    signal_running(children, SIGTERM);
  };

  for (;;) {
    if (g_pending_signal != 0) {
      const int sig = g_pending_signal;
      g_pending_signal = 0;
      if (g_signal_count > 1 || received != 0) {
        fmt::print(stderr, "{}: {} again, killing the ranks\n", o.name, signal_name(sig));
        signal_running(children, SIGKILL);
        killed = true;
      } else {
        // SIGINT goes on as SIGINT (a trainer may treat it as SIGTERM anyway); SIGHUP and
        // SIGQUIT as SIGTERM: a hangup must not kill a rank that would checkpoint on
        // SIGTERM, and SIGQUIT's core dumps are not wanted from every rank.
        const int to_ranks = sig == SIGINT ? SIGINT : SIGTERM;
        fmt::print(stderr, "{}: {} received, sending {} to the ranks\n", o.name, signal_name(sig),
                   signal_name(to_ranks));
        signal_running(children, to_ranks);
        stopping = true;
        deadline = Clock::now() + o.grace;
        received = sig;
      }
      if (received == 0) received = sig;
      if (result == 0) result = 128 + received;
    }

    bool any_running = false, reaped = false;
    for (auto& c : children) {
      if (!c.running) continue;
      int wait_error = 0;
      const Reap r = reap(c, wait_error);
      if (r == Reap::kRunning) {
        any_running = true;
        continue;
      }
      reaped = true;
      c.running = false;
      if (r == Reap::kWaitFailed) {
        // The rank's fate is unknown (e.g. ECHILD: reaped elsewhere): never a success.
        fmt::print(stderr, "{}: rank {} (local rank {}, pid {}): waitpid failed: {}; {}\n", o.name,
                   c.rank, c.local_rank, c.pid, std::strerror(wait_error),
                   stopping ? "counting it as failed" : "stopping the other ranks");
        if (result == 0) result = 1;
        if (!stopping) stop_others();
        continue;
      }
      if (failed(c.status) && !stopping) {
        fmt::print(stderr, "{}: rank {} (local rank {}, pid {}) {}; stopping the other ranks\n",
                   o.name, c.rank, c.local_rank, c.pid, describe(c.status));
        result = exit_status_for(c.status);
        if (result == 0) result = 1;
        stop_others();
      }
    }
    if (!any_running) break;
    if (stopping && !killed && Clock::now() > deadline) {
      for (const auto& c : children) {
        if (c.running) {
          fmt::print(stderr, "{}: rank {} (pid {}) still running after {} ms, sending SIGKILL\n",
                     o.name, c.rank, c.pid, o.grace.count());
        }
      }
      signal_running(children, SIGKILL);
      killed = true;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (received != 0 && result == 128 + received) {
    fmt::print(stderr, "{}: ranks stopped after {}\n", o.name, signal_name(received));
  }
  return result;
}

}  // namespace dtrain::launcher

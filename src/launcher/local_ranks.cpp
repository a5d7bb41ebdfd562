#include "launcher/local_ranks.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
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

volatile sig_atomic_t g_pending_signal = 0;
volatile sig_atomic_t g_signal_count = 0;

void on_signal(int sig) {
  g_pending_signal = sig;
  g_signal_count = g_signal_count + 1;
}

// Installs on_signal for SIGINT and SIGTERM while alive; restores the old handlers after.
class SignalForwarding {
 public:
  SignalForwarding() {
    g_pending_signal = 0;
    g_signal_count = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~SignalForwarding() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

struct Child {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
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

pid_t spawn(const NodeOptions& o, int local_rank, int port) {
  std::map<std::string, std::string> vars = {
      {"RANK", std::to_string(o.node_rank * o.nproc_per_node + local_rank)},
      {"WORLD_SIZE", std::to_string(o.nnodes * o.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(port)}};
  vars.insert(o.environment.begin(), o.environment.end());  // keeps the rank variables
  const std::vector<std::string> env = environment_with(vars);
  try {
    return spawn_process(o.argv[0], o.argv, env);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: local rank {}: {}", o.name, local_rank, e.what()));
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
                    const std::vector<std::string>& env, const std::string& stdout_path,
                    const std::string& stderr_path) {
  std::vector<std::string> args = argv, envs = env;
  std::vector<char*> argp = pointers(args), envp = pointers(envs);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const int flags = O_WRONLY | O_CREAT | O_TRUNC;
  if (!stdout_path.empty())
    posix_spawn_file_actions_addopen(&actions, 1, stdout_path.c_str(), flags, 0644);
  if (!stderr_path.empty() && stderr_path == stdout_path) {
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  } else if (!stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(), flags, 0644);
  }
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults, none;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, program.c_str(), &actions, &attr, argp.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    throw std::runtime_error(fmt::format("cannot start '{}': {}", program, std::strerror(rc)));
  }
  return pid;
}

namespace {

void signal_running(const std::vector<Child>& children, int sig) {
  for (const auto& c : children) {
    if (c.running) kill(c.pid, sig);
  }
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

  std::vector<Child> children;
  for (int l = 0; l < o.nproc_per_node; ++l) {
    Child c;
    c.local_rank = l;
    c.rank = o.node_rank * o.nproc_per_node + l;
    try {
      c.pid = spawn(o, l, port);
    } catch (...) {
      signal_running(children, SIGKILL);
      for (const auto& s : children) waitpid(s.pid, nullptr, 0);
      throw;
    }
    c.running = true;
    children.push_back(c);
  }

  int result = 0;
  bool stopping = false, killed = false;
  int forwarded = 0;
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
      if (g_signal_count > 1 || forwarded != 0) {
        fmt::print(stderr, "{}: {} again, killing the ranks\n", o.name, strsignal(sig));
        signal_running(children, SIGKILL);
        killed = true;
      } else {
        fmt::print(stderr, "{}: forwarding {} to the ranks\n", o.name, strsignal(sig));
        signal_running(children, sig);
        stopping = true;
        deadline = Clock::now() + o.grace;
      }
      forwarded = sig;
      if (result == 0) result = 128 + sig;
    }

    bool any_running = false, reaped = false;
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      const pid_t w = waitpid(c.pid, &status, WNOHANG);
      if (w == 0 || (w < 0 && errno == EINTR)) {
        any_running = true;
        continue;
      }
      reaped = true;
      c.running = false;
      c.status = w == c.pid ? status : 0;
      if (w == c.pid && failed(status) && !stopping) {
        fmt::print(stderr, "{}: rank {} (local rank {}, pid {}) {}; stopping the other ranks\n",
                   o.name, c.rank, c.local_rank, c.pid, describe(status));
        result = exit_status_for(status);
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
  if (forwarded != 0 && result == 128 + forwarded) {
    fmt::print(stderr, "{}: ranks stopped after {}\n", o.name, strsignal(forwarded));
  }
  return result;
}

}  // namespace dtrain::launcher

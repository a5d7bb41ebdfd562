#include "dtrain/launcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "launcher/generation.h"
#include "launcher/spawn.h"
#include "launcher/supervisor.h"

namespace dtrain::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// A signal handler can reach only static storage; these are written by on_signal and read
// (then reset) by the generation loop on the same thread.
volatile sig_atomic_t g_pending_signal = 0;
volatile sig_atomic_t g_signal_count = 0;

void on_signal(int sig) {
  g_pending_signal = sig;
  g_signal_count = g_signal_count + 1;
}

// The signals that stop the job.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
static_assert(std::size(kStopSignals) == 4, "SignalForwarding::old_ holds four");

struct Child {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;       // the rank's supervisor (launcher/supervisor.h); also its process group id
  pid_t rank_pid = -1;  // the rank's own process, for messages
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

SupervisedRank spawn(const NodeOptions& o, const std::string& supervisor, int local_rank,
                     const GenerationSpec& g, bool null_stdin) {
  std::map<std::string, std::string> vars = {
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(g.restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
      {"DTRAIN_GENERATION", std::to_string(g.generation)},
      {"RANK", std::to_string(g.first_rank + local_rank)},
      {"WORLD_SIZE", std::to_string(g.world_size)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"MASTER_ADDR", g.master_addr},
      {"MASTER_PORT", std::to_string(g.master_port)}};
  vars.insert(g.environment.begin(), g.environment.end());
  vars.insert(o.environment.begin(), o.environment.end());  // keeps the rank variables
  const std::vector<std::string> env = environment_with(vars);
  SpawnOptions so;
  so.null_stdin = null_stdin;
  try {
    return spawn_supervised(supervisor, o.argv, env, so);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: local rank {}: {}", o.name, local_rank, e.what()));
  }
}

// Signals the supervisor of every rank that has not been reaped (so its pid cannot belong
// to anyone else); a supervisor forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to its rank's
// process group.
void signal_running(const std::vector<Child>& children, int sig) {
  for (const auto& c : children) {
    if (c.running) kill(c.pid, sig);
  }
}

// Has every running rank's whole tree killed (SIGKILL), by its supervisor.
void kill_trees(const std::vector<Child>& children) { signal_running(children, kKillTreeSignal); }

// A supervisor kills its tree within milliseconds; one still there this long after being
// asked (stopped, or stuck) is SIGKILLed, and its rank gets SIGKILL as its parent-death signal.
constexpr std::chrono::seconds kSupervisorKillTimeout{10};

enum class Reap { kRunning, kEnded, kWaitFailed };

// Reaps `c` if its supervisor ended (it kills the rank's tree before it exits). What is
// left in the supervisor's process group is SIGKILLed first, while the unreaped supervisor
// still holds the group id.
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

SignalForwarding::SignalForwarding() {
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

SignalForwarding::~SignalForwarding() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    sigaction(kStopSignals[i], &old_[i], nullptr);
  }
  sigaction(SIGCHLD, &old_chld_, nullptr);
}

int pending_stop_signal() { return g_pending_signal; }

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
  if (o.max_restarts < 0) throw std::invalid_argument("max_restarts must not be negative");
  if (o.max_restarts > 0 && o.nnodes > 1) {
    throw std::invalid_argument(
        "max_restarts needs nnodes 1 here: restarting the ranks of several nodes together "
        "needs the elastic rendezvous (dtrain-run --nnodes MIN:MAX)");
  }
}

std::vector<std::string> self_command(int argc, char** argv) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::vector<std::string> command{ec ? std::string(argc > 0 ? argv[0] : "") : self.string()};
  for (int i = 1; i < argc; ++i) command.emplace_back(argv[i]);
  return command;
}

GenerationOutcome run_generation(const NodeOptions& o, const std::string& supervisor,
                                 const GenerationSpec& spec, bool null_stdin,
                                 const std::function<bool()>& stop_requested) {
  std::vector<Child> children;
  for (int l = 0; l < o.nproc_per_node; ++l) {
    Child c;
    c.local_rank = l;
    c.rank = spec.first_rank + l;
    try {
      const SupervisedRank started = spawn(o, supervisor, l, spec, null_stdin);
      c.pid = started.supervisor;
      c.rank_pid = started.rank;
    } catch (...) {
      kill_trees(children);
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
  bool stopping = false, killed = false, supervisors_killed = false, rank_failed = false;
  bool stopped = false;
  std::string failure;
  int received = 0;  // the stop signal that arrived first
  Clock::time_point deadline{}, kill_deadline{};
  auto kill_all = [&] {
    kill_trees(children);
    killed = true;
    kill_deadline = Clock::now() + kSupervisorKillTimeout;
  };
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
        kill_all();
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
                   c.rank, c.local_rank, c.rank_pid, std::strerror(wait_error),
                   stopping ? "counting it as failed" : "stopping the other ranks");
        if (result == 0) result = 1;
        if (!stopping) {
          rank_failed = true;
          failure = fmt::format("rank {}: waitpid failed: {}", c.rank, std::strerror(wait_error));
          stop_others();
        }
        continue;
      }
      if (failed(c.status) && !stopping) {
        fmt::print(stderr, "{}: rank {} (local rank {}, pid {}) {}; stopping the other ranks\n",
                   o.name, c.rank, c.local_rank, c.rank_pid, describe(c.status));
        result = exit_status_for(c.status);
        if (result == 0) result = 1;
        rank_failed = true;
        failure =
            fmt::format("rank {} (local rank {}) {}", c.rank, c.local_rank, describe(c.status));
        stop_others();
      }
    }
    if (!any_running) break;
    if (!stopping && stop_requested && stop_requested()) {
      stopped = true;
      stop_others();
    }
    if (stopping && !killed && Clock::now() > deadline) {
      for (const auto& c : children) {
        if (c.running) {
          fmt::print(stderr, "{}: rank {} (pid {}) still running after {} ms, sending SIGKILL\n",
                     o.name, c.rank, c.rank_pid, o.grace.count());
        }
      }
      kill_all();
    }
    if (killed && !supervisors_killed && Clock::now() > kill_deadline) {
      for (const auto& c : children) {
        if (c.running) {
          fmt::print(stderr,
                     "{}: the supervisor of rank {} (pid {}) did not end {} s after it was "
                     "asked to kill the rank's processes; sending it SIGKILL\n",
                     o.name, c.rank, c.pid, kSupervisorKillTimeout.count());
        }
      }
      signal_running(children, SIGKILL);
      supervisors_killed = true;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  GenerationOutcome out;
  out.result = result;
  out.received = received;
  out.failed = rank_failed && received == 0;
  out.stopped = stopped && !rank_failed && received == 0;
  out.failure = failure;
  return out;
}

int run_node(const NodeOptions& o) {
  validate(o);
  const std::string supervisor = find_supervisor(o.supervisor);
  SignalForwarding forwarding;
  const bool null_stdin = isatty(0) == 1;
  for (int restart = 0;; ++restart) {
    GenerationSpec spec;
    spec.generation = spec.restart_count = restart;
    spec.first_rank = o.node_rank * o.nproc_per_node;
    spec.world_size = o.nnodes * o.nproc_per_node;
    spec.master_addr = o.master_addr;
    // A new store port for each generation picked here: nothing of an earlier one can reach it.
    spec.master_port = o.master_port != 0 ? o.master_port : free_port();
    const GenerationOutcome g = run_generation(o, supervisor, spec, null_stdin);
    if (g.received != 0 && g.result == 128 + g.received) {
      fmt::print(stderr, "{}: ranks stopped after {}\n", o.name, signal_name(g.received));
    }
    if (!g.failed || restart >= o.max_restarts) {
      if (g.failed && o.max_restarts > 0) {
        fmt::print(stderr, "{}: no restart left (--max_restarts {}); giving up\n", o.name,
                   o.max_restarts);
      }
      return g.result;
    }
    // A stop signal that came while the ranks were being stopped ends the job here.
    if (g_pending_signal != 0) {
      const int sig = g_pending_signal;
      fmt::print(stderr, "{}: {} received; not restarting\n", o.name, signal_name(sig));
      return 128 + sig;
    }
    fmt::print(stderr, "{}: restarting every rank of this node (restart {} of {})\n", o.name,
               restart + 1, o.max_restarts);
  }
}

}  // namespace dtrain::launcher

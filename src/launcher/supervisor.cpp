// dtrain-supervise's side of launcher/supervisor.h. One thread; every signal it acts on is
// blocked and taken with sigtimedwait, so no handler runs and no state is shared with one.
#include "launcher/supervisor.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/launcher.h"

namespace dtrain::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// Signals forwarded to the rank's process group.
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// This process's children, zombies included: /proc/self/task/<tid>/children where the
// kernel has it (CONFIG_PROC_CHILDREN), else every /proc/<pid>/stat whose parent is us.
// Either may miss a child created meanwhile; the caller repeats until waitpid says ECHILD.
std::vector<pid_t> children_of_self() {
  const pid_t self = getpid();
  std::vector<pid_t> pids;
  std::ifstream list(fmt::format("/proc/self/task/{}/children", self));
  if (list) {
    pid_t p;
    while (list >> p) pids.push_back(p);
    return pids;
  }
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return pids;
  while (const dirent* e = readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    std::string line;
    if (!std::getline(stat, line)) continue;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 1));
    std::string state;
    long ppid = 0;
    if (rest >> state >> ppid && ppid == self) pids.push_back(static_cast<pid_t>(pid));
  }
  closedir(proc);
  return pids;
}

class Supervisor {
 public:
  Supervisor(pid_t launcher, pid_t rank) : launcher_(launcher), rank_(rank) {}

  // Until the rank ends or the tree is to be killed; then kills the tree.
  void run(const sigset_t& waited) {
    for (;;) {
      const timespec tick{0, 200 * 1000 * 1000};
      siginfo_t info{};
      int sig = sigtimedwait(&waited, &info, &tick);
      // PDEATHSIG is tied to the launcher's thread; checking the parent also covers a
      // launcher that died before the signal was armed in a way we could not see.
      if (getppid() != launcher_) sig = kKillTreeSignal;
      if (sig == kKillTreeSignal) break;
      for (const int s : kForwarded) {
        if (sig == s && !rank_reaped_) kill(-rank_, sig);
      }
      if (reap_until_rank_ended()) break;
    }
    kill_tree();
  }

  // The exit status for the rank's fate (1 if it could not be waited for).
  [[noreturn]] void exit_like_the_rank() const {
    if (!rank_reaped_) _exit(1);
    if (WIFEXITED(rank_status_)) _exit(WEXITSTATUS(rank_status_));
    if (WIFSIGNALED(rank_status_)) {
      const int sig = WTERMSIG(rank_status_);
      const rlimit no_core{0, 0};
      setrlimit(RLIMIT_CORE, &no_core);  // the rank dumped core already, if it was to
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(sig, &dfl, nullptr);
      sigset_t only;
      sigemptyset(&only);
      sigaddset(&only, sig);
      sigprocmask(SIG_UNBLOCK, &only, nullptr);
      raise(sig);
      _exit(128 + sig);  // a signal whose default is not to terminate
    }
    _exit(1);
  }

 private:
  // Reaps the children that ended. The rank is first only looked at (WNOWAIT): its process
  // group is killed while the unreaped rank still holds the group id. True once the rank
  // was reaped.
  bool reap_until_rank_ended() {
    for (;;) {
      siginfo_t info{};
      const int rc = waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT);
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0 || info.si_pid == 0) return rank_reaped_;
      if (info.si_pid == rank_ && !rank_reaped_) kill(-rank_, SIGKILL);
      reap(info.si_pid);
    }
  }

  void reap(pid_t pid) {
    int status = 0;
    pid_t w;
    do {
      w = waitpid(pid, &status, 0);
    } while (w < 0 && errno == EINTR);
    if (w == rank_) {
      rank_reaped_ = true;
      rank_status_ = status;
    }
  }

  // SIGKILLs the tree top-down until this process has no child left. Only unreaped
  // children are signalled, so no pid can have been reused by a process outside the tree.
  void kill_tree() {
    if (!rank_reaped_) kill(-rank_, SIGKILL);
    const auto start = Clock::now();
    bool warned = false;
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    for (;;) {
      pid_t w;
      int status = 0;
      while ((w = waitpid(-1, &status, WNOHANG)) > 0 || (w < 0 && errno == EINTR)) {
        if (w == rank_) {
          rank_reaped_ = true;
          rank_status_ = status;
        }
      }
      if (w < 0) return;  // ECHILD: the tree is gone
      const std::vector<pid_t> children = children_of_self();
      for (const pid_t c : children) kill(c, SIGKILL);
      const auto waited = Clock::now() - start;
      if (!warned && waited > std::chrono::seconds(10)) {
        // Only a process in an uninterruptible sleep outlives SIGKILL this long.
        std::string pids;
        for (const pid_t c : children) pids += fmt::format(" {}", c);
        fmt::print(stderr,
                   "dtrain-supervise: rank pid {}: after 10 s of SIGKILL, still running:{}\n",
                   rank_, pids);
        warned = true;
      }
      const timespec tick{0, 10 * 1000 * 1000};
      sigtimedwait(&chld, nullptr, &tick);
    }
  }

  const pid_t launcher_;
  const pid_t rank_;
  bool rank_reaped_ = false;
  int rank_status_ = 0;
};

void report(const std::string& line) {
  const std::string text = line + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(kPassedFd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the launcher is gone: kKillTreeSignal follows
    done += static_cast<size_t>(n);
  }
}

}  // namespace

int supervise(pid_t launcher, const std::vector<std::string>& argv) {
  // The report pipe must not reach the rank.
  if (fcntl(kPassedFd, F_SETFD, FD_CLOEXEC) != 0) {
    fmt::print(stderr,
               "dtrain-supervise: no report pipe on descriptor {} (started by hand? it is "
               "started by dtrain-run and dtrain::launcher::run_node)\n",
               kPassedFd);
    return 127;
  }
  // Taken with sigtimedwait. The launcher started us with everything blocked, so a signal
  // that came before this point is pending, not lost. SIGPIPE stays blocked: a report to a
  // launcher that died is an EPIPE, not our death.
  sigset_t waited;
  sigemptyset(&waited);
  for (const int s : {SIGCHLD, kKillTreeSignal, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) {
    sigaddset(&waited, s);
    // Ignored, SIGCHLD would make the kernel reap our children and lose the rank's status.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(s, &dfl, nullptr);
  }
  sigset_t mask = waited;
  sigaddset(&mask, SIGPIPE);
  sigprocmask(SIG_SETMASK, &mask, nullptr);
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    report(fmt::format("failed cannot start '{}': prctl(PR_SET_CHILD_SUBREAPER): {}", argv[0],
                       std::strerror(errno)));
    return 127;
  }
  if (getppid() != launcher) return 127;  // the launcher died before we were ready

  SpawnOptions rank_options;
  rank_options.own_process_group = true;
  rank_options.parent_death_signal = SIGKILL;
  pid_t rank = -1;
  try {
    rank = spawn_process(argv[0], argv, environment_with({}), rank_options);
  } catch (const std::exception& e) {
    report(fmt::format("failed {}", e.what()));
    return 127;
  }
  report(fmt::format("started {}", rank));
  close(kPassedFd);

  Supervisor supervisor(launcher, rank);
  supervisor.run(waited);
  supervisor.exit_like_the_rank();
}

}  // namespace dtrain::launcher

// The per-rank supervisor, dtrain-supervise, and how a launcher talks to it.
//
// run_node (dtrain/launcher.h) starts every rank under its own supervisor process:
//
//   launcher ── dtrain-supervise ── rank ── whatever the rank starts (any depth, any session)
//
// The supervisor is a child subreaper (PR_SET_CHILD_SUBREAPER): a process of the rank's
// tree whose parent dies is reparented to it, not to init, even one that double-forked into
// a session of its own. So it can always find and kill the whole tree: SIGKILL its direct
// children (whose pids cannot be reused while they are unreaped), reap them, and repeat with
// the orphans that arrive, until it has no child left. Its parent-death signal is
// kKillTreeSignal, so a launcher that dies in any way, SIGKILL included, has the tree killed.
// It is a small program of its own (no LibTorch), started by fork and an immediate exec:
// a launcher with LibTorch loaded must not run anything but exec in a forked child.
//
// The protocol:
// - argv: dtrain-supervise LAUNCHER_PID -- PROGRAM ARGS...; the environment is the rank's;
//   the rank's stdin/stdout/stderr are the supervisor's.
// - Descriptor kPassedFd (3) is a pipe to the launcher. The supervisor writes one line,
//   "started <pid of the rank>" or "failed <why the rank could not start>", and closes it.
// - SIGINT, SIGTERM, SIGHUP, SIGQUIT to the supervisor are forwarded to the rank's process
//   group (the rank leads one).
// - kKillTreeSignal (also its parent-death signal; and when its parent is no longer
//   LAUNCHER_PID) kills the whole tree with SIGKILL.
// - When the rank ends, whatever is left of its tree is killed. The supervisor then exits
//   as the rank did: with its exit code, or killed by the same signal (without a core dump).
// - If the supervisor itself is SIGKILLed, the rank gets SIGKILL (its parent-death signal);
//   what the rank started is then reparented above the supervisor. That is the one way out
//   of a tree, and only for someone who can signal the supervisor.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "launcher/spawn.h"

namespace dtrain::launcher {

// Asks a supervisor to kill its rank's whole tree now; also its parent-death signal.
constexpr int kKillTreeSignal = SIGUSR1;

struct SupervisedRank {
  pid_t supervisor = -1;  // the launcher's child: wait for it, signal it
  pid_t rank = -1;        // the rank's process, for messages
};

// The supervisor program to start: `configured` if not empty, else dtrain-supervise next
// to this program's executable, in the bin directory dtrain was installed to, or in its
// build tree, the first that is executable. Throws std::runtime_error naming the places
// tried.
std::string find_supervisor(const std::string& configured);

// Starts `argv` as a rank under the supervisor program `supervisor`, with `env`. `options`
// apply to the supervisor, hence to the rank (output files, stdin); the supervisor always
// leads its own process group, starts with its signals blocked and gets kKillTreeSignal
// when the calling thread ends. Waits (at most 60 s) for the supervisor's report. Throws
// std::runtime_error naming the program and the cause when the rank cannot be started; the
// supervisor is then already reaped.
SupervisedRank spawn_supervised(const std::string& supervisor, const std::vector<std::string>& argv,
                                const std::vector<std::string>& env, SpawnOptions options);

// dtrain-supervise's main loop (the process's only thread; its report pipe is kPassedFd):
// starts argv, supervises it as described above, kills what is left of the tree and
// returns the exit status to exit with; for a rank killed by a signal it raises that
// signal itself and does not return. Returns 127 when the rank cannot be started.
int supervise(pid_t launcher, const std::vector<std::string>& argv);

}  // namespace dtrain::launcher

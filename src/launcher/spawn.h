// Starting one child process by fork and an immediate exec, the way run_node starts a rank
// (dtrain/launcher.h); also what multi-process tests start their ranks with.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace dtrain::launcher {

struct SpawnOptions {
  // stdout/stderr go to these files (truncated; "" keeps the parent's; the same path for
  // both shares one file).
  std::string stdout_path;
  std::string stderr_path;
  // stdin from /dev/null instead of the parent's.
  bool null_stdin = false;
  // The child leads a new process group (its pgid is its pid), so kill(-pid, sig) reaches
  // it and everything it starts.
  bool own_process_group = false;
  // Signal the child gets when the calling thread ends (0: none). The child checks that
  // the parent is still there after setting it, so a parent that dies during the spawn
  // cannot leave it running.
  int parent_death_signal = 0;
  // The child starts with every signal blocked instead of none, so that a signal sent
  // before it is ready (its parent-death signal, a stop request) stays pending until it
  // takes it with sigwaitinfo. For dtrain-supervise (launcher/supervisor.h).
  bool block_signals = false;
  // A descriptor of the caller that the child gets as descriptor kPassedFd (3), open across
  // exec; -1: none. Every other descriptor the caller opened close-on-exec stays closed.
  int pass_fd = -1;
};

// Where SpawnOptions::pass_fd arrives in the child.
constexpr int kPassedFd = 3;

// Starts `program` (looked up in PATH unless it contains a '/') with `argv` and `env`, by
// fork and an immediate exec. SIGINT, SIGTERM, SIGHUP and SIGQUIT start at their defaults
// in the child, with no signal blocked (every signal with block_signals). Throws std::runtime_error
// naming the program (or the output file) and the cause when it cannot start; the child is then
// already reaped.
pid_t spawn_process(const std::string& program, const std::vector<std::string>& argv,
                    const std::vector<std::string>& env, const SpawnOptions& options);

// The same with default SpawnOptions apart from the output files.
pid_t spawn_process(const std::string& program, const std::vector<std::string>& argv,
                    const std::vector<std::string>& env, const std::string& stdout_path = "",
                    const std::string& stderr_path = "");

// A TCP port on 127.0.0.1 in [20000, 32000) that was free a moment ago.
int free_port();

}  // namespace dtrain::launcher

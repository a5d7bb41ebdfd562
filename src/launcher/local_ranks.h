// Starting and supervising the ranks of one node as child processes: the core of
// dtrain-run, also used by programs that launch themselves (gpt2_train --nproc).
//
// Plain POSIX and fmt, no LibTorch: it compiles fast, and a process that supervises its
// ranks never needs to initialize torch. Children are started with posix_spawn (an exec,
// never a bare fork, which deadlocks in LibTorch's OpenMP runtime), so calling it after
// torch ran is also safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace dtrain::launcher {

struct NodeOptions {
  // The command each rank runs: argv[0] is looked up in PATH unless it contains a '/'.
  std::vector<std::string> argv;
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;  // this node's index in [0, nnodes)
  std::string master_addr = "127.0.0.1";
  // Where rank 0 serves the store. 0 picks a free local port, which only works for a
  // single node (other nodes could not know it).
  int master_port = 0;
  // After a rank failed: how long the others get between SIGTERM and SIGKILL.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  // Prefix of the messages printed on stderr.
  std::string name = "dtrain-run";
  // Variables added to every rank's environment (e.g. the OPENBLAS_CORETYPE a
  // dtrain::BlasKernelPlan selects); the rank variables above take precedence.
  std::map<std::string, std::string> environment;
};

// Throws std::invalid_argument naming the bad option.
void validate(const NodeOptions& options);

// Runs this node's ranks and waits for them. Rank r (local rank l) gets this process's
// environment plus `environment` and RANK=node_rank*nproc_per_node+l,
// WORLD_SIZE=nnodes*nproc_per_node, LOCAL_RANK=l, LOCAL_WORLD_SIZE=nproc_per_node,
// MASTER_ADDR and MASTER_PORT.
//
// SIGINT and SIGTERM received meanwhile are forwarded to the ranks (a second one kills
// them). When a rank fails (non-zero exit or a signal), prints which rank failed and how,
// sends SIGTERM to the others and SIGKILL to those still running after `grace`.
//
// Returns the status to exit with: 0 when every rank exited 0; else the failed rank's exit
// code, or 128 + signal number when it was killed by a signal (or a signal was forwarded).
// Throws std::runtime_error when a rank cannot be started (the ones already started are
// killed first).
int run_node(const NodeOptions& options);

// This process's environment as KEY=VALUE strings, without the names in `remove`, with
// `overrides` set.
std::vector<std::string> environment_with(const std::map<std::string, std::string>& overrides,
                                          const std::set<std::string>& remove = {});

// Starts `program` (looked up in PATH unless it contains a '/') with `argv` and `env`, by
// posix_spawn: an exec, safe after LibTorch ran. SIGINT/SIGTERM start at their defaults in
// the child. stdout/stderr go to the given files (truncated; "" keeps the parent's; the
// same path for both shares one file). Throws std::runtime_error when it cannot start.
pid_t spawn_process(const std::string& program, const std::vector<std::string>& argv,
                    const std::vector<std::string>& env, const std::string& stdout_path = "",
                    const std::string& stderr_path = "");

// A TCP port on 127.0.0.1 in [20000, 32000) that was free a moment ago.
int free_port();

}  // namespace dtrain::launcher

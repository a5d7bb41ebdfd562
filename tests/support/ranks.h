// Helpers to run several ranks inside one test: as threads over an in-memory store
// (fast), or as separate processes started by fork and an immediate exec (launcher/spawn.h;
// never a bare fork: LibTorch's OpenMP runtime deadlocks in a forked child).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/communicator.h"
#include "launcher/spawn.h"

namespace dtrain::testing {

// Runs fn(rank) on world_size threads. Waits for all, then rethrows the first exception.
void run_threads(int world_size, const std::function<void(int rank)>& fn);

// Runs fn(comm) on world_size threads, each with its own communicator (`options`: which
// transport, timeouts) over one in-memory store. Waits for all,
// then rethrows the first exception. Checks inside fn must throw (not ASSERT_*), so that a
// failing rank cannot leave its peers blocked: they time out instead.
void run_ranks(int world_size, const std::function<void(Communicator&)>& fn,
               CommunicatorOptions options = {});

// A TCP port that was free a moment ago (the launcher's choice, shared by all tools).
using launcher::free_port;

struct ProcessResult {
  int exit_code = -1;  // -1 if killed by a signal
  int signal = 0;
  std::string output;  // stdout + stderr
};

// Starts `argv` with extra environment variables; returns its pid. Output goes to a file
// read back by wait_process.
struct Process {
  int pid = -1;
  std::string log_path;
};
Process spawn_process(const std::vector<std::string>& argv,
                      const std::map<std::string, std::string>& env);
// Waits up to timeout_s; kills the process (SIGKILL) if it is still running then.
ProcessResult wait_process(const Process& p, double timeout_s);

// Environment for rank `rank` of a local job of `world_size` processes.
std::map<std::string, std::string> rank_env(int rank, int world_size, int port);

}  // namespace dtrain::testing

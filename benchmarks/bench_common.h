// Shared driver of dtrain's multi-process Google Benchmark programs.
//
// A benchmark program is started once by the user. With --nproc=N it spawns N-1 copies of
// itself (posix_spawn of /proc/self/exe: never fork after LibTorch ran) with the torchrun
// environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE)
// and becomes rank 0. Every rank registers and runs the same benchmarks; only rank 0
// reports, the copies run with a silent reporter and their stdout discarded (their stderr
// is kept in a log that rank 0 prints when a copy fails). A program started by an
// external launcher (RANK already set) does not spawn anything.
//
// Google Benchmark picks iteration counts adaptively, which would differ between ranks
// and deadlock the collectives: every benchmark registered through this driver must fix
// its iteration count (Benchmark::Iterations), and must agree across ranks on whether it
// skips (see all_ranks_ok).
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/communicator.h"

namespace dtrain::bench {

// The program's own command-line flags, --name=value or --name value. Parsed flags are
// removed from argv; the rest goes to Google Benchmark.
class Flags {
 public:
  void add(const std::string& name, int64_t* value, const std::string& help);
  void add(const std::string& name, double* value, const std::string& help);
  void add(const std::string& name, std::string* value, const std::string& help);
  // Removes the flags it knows from argv. Throws std::invalid_argument on a malformed value.
  void parse(int* argc, char** argv);
  void print_help(const char* program) const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::function<void(const std::string&)> set;
    std::string current;
  };
  std::vector<Flag> flags_;
};

// Parses "512,1024,2048" into numbers.
std::vector<int64_t> parse_int_list(const std::string& text);

// Human-readable byte count: 4096 -> "4KiB".
std::string format_bytes(int64_t bytes);

// Number of iterations for a message of `bytes`: about target_bytes moved in all, clamped
// to [min_iters, max_iters]. A pure function of its arguments, so equal on every rank.
int64_t iterations_for(int64_t bytes, int64_t target_bytes, int64_t min_iters, int64_t max_iters);

// Reports a failure of benchmark `name` on this rank: SkipWithError, a line on stderr
// naming the rank, and a non-zero exit status of the program. `comm_broken`: the failure
// was a communication error (the communicator is unusable from now on).
void fail(benchmark::State& state, const Communicator& comm, const std::string& name,
          const std::string& message, bool comm_broken = false);

// After a communication failure every later benchmark would fail the same way: skips it
// quietly and returns true.
bool skip_after_comm_failure(benchmark::State& state);

// Registers benchmark `name`, whose body runs on every rank: skipped (quietly) after an
// earlier communication failure, and an exception escaping `body` fails it on this rank as
// a communication failure (see fail). Returns Google Benchmark's handle, to fix the
// iteration count on.
benchmark::internal::Benchmark* register_benchmark(const std::string& name,
                                                   const Communicator& comm,
                                                   std::function<void(benchmark::State&)> body);

// Collective agreement on a check: every rank passes whether its own check passed; returns
// true on every rank iff all passed. When it returns false, failed_ranks lists the ranks
// that failed (on every rank), so that all ranks skip the same benchmark and stay in step.
bool all_ranks_ok(Communicator& comm, bool ok, std::string* failed_ranks);

// Everything after flag parsing: launches the ranks, connects a Gloo communicator with
// options built from the common flags, calls register_benchmarks(comm), runs the
// benchmarks and waits for the spawned ranks. Returns the program's exit status: 0 only if
// every rank finished with no failed benchmark.
//
// Common flags (added to `flags` here): --nproc, --timeout_s, --transport (auto|gloo|shm),
// --shm_chunk_bytes, --gloo_segment_bytes, --gloo_iface.
int bench_main(int argc, char** argv, Flags& flags,
               const std::function<void(Communicator&)>& register_benchmarks);

}  // namespace dtrain::bench

// Shared driver of dtrain's multi-process Google Benchmark programs.
//
// A benchmark program is started once by the user. With --nproc=N it starts N copies of
// itself as ranks 0..N-1 with dtrain's launcher (dtrain/launcher.h, what dtrain-run and
// gpt2_train --nproc run: fork and exec, a process group per rank, the parent-death signal, a
// failed rank stopping the others) and exits with their status. Every rank registers and
// runs the same benchmarks; only rank 0 reports (and writes --benchmark_out), the others run
// with a silent reporter. A program started by an external launcher (RANK already set) is
// that rank and starts nothing (RANK set, or OMPI_COMM_WORLD_RANK under mpirun).
//
// Command line: Google Benchmark's --benchmark_* flags, then the program's own flags, which
// are Abseil flags (ABSL_FLAG in the program's file; the common ones below), parsed by
// dtrain_cli (--name=value or --name value). A usage error exits with status 2.
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

// The whole program: parses the command line; unless this process is already a rank,
// starts the ranks and returns their exit status; as a rank, connects a communicator with
// options from the common flags, calls register_benchmarks(comm) (the program's flags are
// parsed by then: it reads them with absl::GetFlag and throws std::invalid_argument for a
// bad value), runs the benchmarks and returns this rank's exit status: 0 only if it
// finished with no failed benchmark.
//
// Common flags: --nproc, --timeout_s, --backend (gloo|mpi), --transport (auto|gloo|shm),
// --shm_chunk_bytes, --gloo_segment_bytes, --gloo_iface (see --help).
int bench_main(int argc, char** argv,
               const std::function<void(Communicator&)>& register_benchmarks);

}  // namespace dtrain::bench

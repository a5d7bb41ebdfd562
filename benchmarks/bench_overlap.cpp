// dtrain_bench_overlap: how much of FSDP's communication hides behind compute.
//
// The FSDP backward pattern: while unit k computes, the all-gather of unit k+1's
// parameters (prefetch) and the reduce-scatter of unit k-1's gradients are in flight. Here
// the compute is one fp32 N x N matmul on one intra-op thread; the communication is an
// all-gather into a `unit_bytes` buffer and a reduce-scatter from a `unit_bytes` buffer,
// both issued asynchronously (the Gloo backend runs them on its own thread). Every
// iteration measures, with a barrier before each phase:
//   compute  the matmul alone
//   comm     all-gather + reduce-scatter alone (issue both, wait both)
//   both     issue both, run the matmul, wait both
// and reports the means and overlap efficiency = (compute + comm - both) / min(compute,
// comm): 1 when the shorter one hides completely, 0 when they serialise, negative when
// running them together is slower than one after the other.
//
// --sleep_ms adds runs whose "compute" is a sleep that uses no CPU: they separate what the
// library overlaps from what the cores allow (on a host with fewer cores than ranks times
// busy threads, the matmul and the transport compete for the same cores).
//
//   dtrain_bench_overlap --nproc=2 --unit_bytes=16777216 --matmul=512,1024,2048
#include <ATen/ATen.h>
#include <absl/flags/flag.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_common.h"

ABSL_FLAG(int64_t, unit_bytes, 16 << 20,
          "bytes of one FSDP unit (the gathered parameters; also the gradient buffer)");
ABSL_FLAG(std::string, matmul, "512,1024,2048", "comma-separated matmul sizes N (N x N x N, fp32)");
ABSL_FLAG(std::string, sleep_ms, "",
          "comma-separated sleep durations (ms) to run as a CPU-free compute stand-in");
ABSL_FLAG(int64_t, iters, 10, "timed iterations per compute size (same on every rank)");
ABSL_FLAG(int64_t, corrupt_rank, -1,
          "testing hook: this rank perturbs its verified result (the run must fail)");

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The flags; constructed once the command line is parsed.
struct Config {
  int64_t unit_bytes = absl::GetFlag(FLAGS_unit_bytes);
  std::string matmul = absl::GetFlag(FLAGS_matmul);
  std::string sleep_ms = absl::GetFlag(FLAGS_sleep_ms);
  int64_t iters = absl::GetFlag(FLAGS_iters);
  int64_t corrupt_rank = absl::GetFlag(FLAGS_corrupt_rank);
};

// ((offset + i) % 13) + 1 in fp32, exact under sums over few ranks.
at::Tensor pattern(int64_t n, int64_t offset) {
  return (at::arange(offset, offset + n, at::kInt).remainder(13) + 1).to(at::kFloat);
}

// The stand-in for unit k's forward/backward: an n x n matmul, or a sleep when sleep_ms > 0.
struct Compute {
  int64_t n = 0;
  int64_t sleep_ms = 0;
};

void run(benchmark::State& state, const std::string& name, Communicator& comm, const Compute& work,
         const Config& cfg) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  const int64_t numel = cfg.unit_bytes / static_cast<int64_t>(sizeof(float));
  const int64_t shard = numel / world;
  // Unit k+1: this rank's parameter shard, gathered into the full unit.
  at::Tensor params_shard = pattern(shard, rank * shard) * static_cast<float>(rank + 1);
  at::Tensor params_full = at::full({numel}, -1.0f);
  // Unit k-1: the full gradient, reduce-scattered into this rank's shard.
  at::Tensor grads_full = pattern(numel, 0) * static_cast<float>(rank + 1);
  at::Tensor grads_shard = at::full({shard}, -1.0f);
  // Unit k: the compute.
  const int64_t n = work.sleep_ms > 0 ? 1 : work.n;
  at::Tensor a = at::randn({n, n});
  at::Tensor b = at::randn({n, n});
  at::Tensor c = at::empty({n, n});
  auto run_compute = [&] {
    if (work.sleep_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(work.sleep_ms));
    } else {
      at::mm_out(c, a, b);
    }
  };

  auto issue_comm = [&] {
    std::vector<WorkPtr> works;
    works.push_back(comm.all_gather(params_full, params_shard));
    works.push_back(comm.reduce_scatter(grads_shard, grads_full));
    return works;
  };
  auto wait_all = [](std::vector<WorkPtr>& works) {
    for (auto& w : works) w->wait();
  };

  // Verify the communication once (also the warm-up of connections and allocator).
  {
    auto works = issue_comm();
    run_compute();
    wait_all(works);
    if (rank == cfg.corrupt_rank) grads_shard[0] += 1;  // test hook: must be caught
    const float rank_sum = static_cast<float>(world) * (world + 1) / 2;
    at::Tensor gathered = (pattern(numel, 0).view({world, shard}) *
                           at::arange(1, world + 1, at::kFloat).view({world, 1}))
                              .view({numel});
    const bool ok = at::equal(params_full, gathered) &&
                    at::equal(grads_shard, pattern(shard, rank * shard) * rank_sum);
    std::string failed;
    if (!all_ranks_ok(comm, ok, &failed)) {
      fail(state, comm, name,
           "verification failed: all_gather/reduce_scatter result differs on rank(s) " + failed);
      return;
    }
  }

  double compute_s = 0, comm_s = 0, both_s = 0;
  for (auto _ : state) {
    comm.barrier()->wait();
    auto t0 = Clock::now();
    run_compute();
    compute_s += seconds_since(t0);

    comm.barrier()->wait();
    t0 = Clock::now();
    {
      auto works = issue_comm();
      wait_all(works);
    }
    comm_s += seconds_since(t0);

    comm.barrier()->wait();
    t0 = Clock::now();
    {
      auto works = issue_comm();
      run_compute();
      wait_all(works);
    }
    const double both = seconds_since(t0);
    both_s += both;
    state.SetIterationTime(both);
  }
  const double k = static_cast<double>(state.iterations());
  const double compute = compute_s / k, comm_t = comm_s / k, both = both_s / k;
  state.SetBytesProcessed(2 * cfg.unit_bytes * state.iterations());
  state.counters["matmul_n"] = static_cast<double>(work.sleep_ms > 0 ? 0 : work.n);
  state.counters["sleep_ms"] = static_cast<double>(work.sleep_ms);
  state.counters["unit_bytes"] = static_cast<double>(cfg.unit_bytes);
  state.counters["compute_ms"] = compute * 1e3;
  state.counters["comm_ms"] = comm_t * 1e3;
  state.counters["both_ms"] = both * 1e3;
  state.counters["matmul_gflops"] = work.sleep_ms > 0 ? 0 : 2.0 * n * n * n / compute * 1e-9;
  state.counters["overlap_eff"] = (compute + comm_t - both) / std::min(compute, comm_t);
}

}  // namespace
}  // namespace dtrain::bench

int main(int argc, char** argv) {
  using namespace dtrain::bench;
  return bench_main(argc, argv, [](dtrain::Communicator& comm) {
    const Config cfg;  // from the flags, parsed by now
    const int64_t align = static_cast<int64_t>(sizeof(float)) * comm.world_size();
    if (cfg.unit_bytes <= 0 || cfg.unit_bytes % align != 0) {
      throw std::invalid_argument("--unit_bytes must be a positive multiple of 4 * ranks");
    }
    if (cfg.iters < 1) throw std::invalid_argument("--iters must be >= 1");
    std::vector<std::pair<std::string, Compute>> runs;
    for (int64_t n : parse_int_list(cfg.matmul))
      runs.push_back({"matmul:" + std::to_string(n), {n, 0}});
    for (int64_t ms : parse_int_list(cfg.sleep_ms)) {
      runs.push_back({"sleep:" + std::to_string(ms) + "ms", {0, ms}});
    }
    for (const auto& [label, work] : runs) {
      const std::string name = "overlap/ranks:" + std::to_string(comm.world_size()) +
                               "/unit:" + format_bytes(cfg.unit_bytes) + "/" + label;
      register_benchmark(name, comm,
                         [&comm, cfg, work = work, name](benchmark::State& state) {
                           run(state, name, comm, work, cfg);
                         })
          ->Iterations(cfg.iters)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  });
}

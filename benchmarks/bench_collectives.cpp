// dtrain_bench_collectives: bandwidth of all-reduce, all-gather, reduce-scatter and
// broadcast (fp32, Gloo, one process per rank) over a sweep of message sizes.
//
//   dtrain_bench_collectives --nproc=4 --max_bytes=268435456 --benchmark_format=csv
//
// Conventions follow nccl-tests: "bytes" is the largest buffer of the call (all-gather:
// the gathered output; reduce-scatter: the input before scattering); algbw = bytes / time;
// busbw = algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for all-gather and
// reduce-scatter, algbw for broadcast. Each size is verified once against a closed form
// before it is timed; a mismatch on any rank fails the benchmark on every rank and makes
// the program exit non-zero. Timing: after one barrier, each call is timed on its own
// (issue to wait() returning) with the calls back to back; the reported time is rank 0's
// mean. Iteration counts are fixed per size (see iterations_for), equal on every rank.
#include <ATen/ATen.h>
#include <absl/flags/flag.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.h"

ABSL_FLAG(int64_t, min_bytes, 4 << 10, "smallest message, bytes");
ABSL_FLAG(int64_t, max_bytes, 256 << 20, "largest message, bytes");
ABSL_FLAG(int64_t, step, 4, "factor between consecutive sizes (2 or 4)");
ABSL_FLAG(int64_t, target_bytes, 1 << 30,
          "iterations per size = target_bytes / size, clamped to [min_iters, max_iters]");
ABSL_FLAG(int64_t, min_iters, 3, "fewest timed iterations per size");
ABSL_FLAG(int64_t, max_iters, 100, "most timed iterations per size");
ABSL_FLAG(std::string, ops, "all_reduce,all_gather,reduce_scatter,broadcast",
          "comma-separated collectives to run");
ABSL_FLAG(int64_t, barrier, 0,
          "0: time back-to-back calls after one barrier (nccl-tests style); 1: a barrier before "
          "each timed call (adds the ranks' skew leaving the barrier to small sizes)");
ABSL_FLAG(int64_t, corrupt_rank, -1,
          "testing hook: this rank perturbs its verified result (the run must fail)");

namespace dtrain::bench {
namespace {

enum class Collective { kAllReduce, kAllGather, kReduceScatter, kBroadcast };

struct CollectiveInfo {
  Collective kind;
  const char* name;
};

constexpr CollectiveInfo kCollectives[] = {
    {Collective::kAllReduce, "all_reduce"},
    {Collective::kAllGather, "all_gather"},
    {Collective::kReduceScatter, "reduce_scatter"},
    {Collective::kBroadcast, "broadcast"},
};

double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::kAllReduce:
      return 2.0 * (n - 1) / n;
    case Collective::kAllGather:
    case Collective::kReduceScatter:
      return static_cast<double>(n - 1) / n;
    case Collective::kBroadcast:
      return 1.0;
  }
  return 1.0;
}

// Small exact integers in fp32: ((offset + i) % 13) + 1 for i in [0, n). Sums over up to
// 64 ranks stay exact, so results are compared for equality.
at::Tensor pattern(int64_t n, int64_t offset) {
  return (at::arange(offset, offset + n, at::kInt).remainder(13) + 1).to(at::kFloat);
}

// Buffers of one collective at one size, filled so that the result has a closed form.
struct Buffers {
  at::Tensor a;  // in-place tensor (all-reduce, broadcast) or output
  at::Tensor b;  // input of all-gather / reduce-scatter
};

Buffers make_buffers(Collective c, int64_t numel, int rank, int world) {
  const int64_t shard = numel / world;
  const float scale = static_cast<float>(rank + 1);
  switch (c) {
    case Collective::kAllReduce:
      return {pattern(numel, 0) * scale, {}};
    case Collective::kAllGather:
      return {at::full({numel}, -1.0f), pattern(shard, rank * shard) * scale};
    case Collective::kReduceScatter:
      return {at::full({shard}, -1.0f), pattern(numel, 0) * scale};
    case Collective::kBroadcast:
      return {rank == 0 ? pattern(numel, 0) : at::full({numel}, -1.0f), {}};
  }
  return {};
}

WorkPtr issue(Communicator& comm, Collective c, Buffers& buf) {
  switch (c) {
    case Collective::kAllReduce:
      return comm.all_reduce(buf.a);
    case Collective::kAllGather:
      return comm.all_gather(buf.a, buf.b);
    case Collective::kReduceScatter:
      return comm.reduce_scatter(buf.a, buf.b);
    case Collective::kBroadcast:
      return comm.broadcast(buf.a, 0);
  }
  return nullptr;
}

// The result the first call must produce on `rank` (output buffer `a`).
at::Tensor expected(Collective c, int64_t numel, int rank, int world) {
  const int64_t shard = numel / world;
  const float rank_sum = static_cast<float>(world) * (world + 1) / 2;
  switch (c) {
    case Collective::kAllReduce:
      return pattern(numel, 0) * rank_sum;
    case Collective::kAllGather:
      return (pattern(numel, 0).view({world, shard}) *
              at::arange(1, world + 1, at::kFloat).view({world, 1}))
          .view({numel});
    case Collective::kReduceScatter:
      return pattern(shard, rank * shard) * rank_sum;
    case Collective::kBroadcast:
      return pattern(numel, 0);
  }
  return {};
}

// The flags; constructed once the command line is parsed.
struct Config {
  int64_t min_bytes = absl::GetFlag(FLAGS_min_bytes);
  int64_t max_bytes = absl::GetFlag(FLAGS_max_bytes);
  int64_t step = absl::GetFlag(FLAGS_step);
  int64_t target_bytes = absl::GetFlag(FLAGS_target_bytes);
  int64_t min_iters = absl::GetFlag(FLAGS_min_iters);
  int64_t max_iters = absl::GetFlag(FLAGS_max_iters);
  std::string ops = absl::GetFlag(FLAGS_ops);
  int64_t corrupt_rank = absl::GetFlag(FLAGS_corrupt_rank);
  int64_t barrier = absl::GetFlag(FLAGS_barrier);
};

void run(benchmark::State& state, const std::string& name, Communicator& comm, Collective c,
         int64_t bytes, const Config& cfg) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  const int64_t numel = bytes / static_cast<int64_t>(sizeof(float));
  // Verify once per size, before timing.
  Buffers buf = make_buffers(c, numel, rank, world);
  issue(comm, c, buf)->wait();
  if (rank == cfg.corrupt_rank) buf.a.view({-1})[0] += 1;  // test hook: must be caught
  const bool ok = at::equal(buf.a, expected(c, numel, rank, world));
  std::string failed;
  if (!all_ranks_ok(comm, ok, &failed)) {
    fail(state, comm, name,
         "verification failed: result differs from the closed form on rank(s) " + failed);
    return;
  }

  double total_s = 0;
  std::vector<double> times;
  times.reserve(static_cast<size_t>(state.max_iterations));
  comm.barrier()->wait();
  for (auto _ : state) {
    if (cfg.barrier != 0) comm.barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    issue(comm, c, buf)->wait();
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    state.SetIterationTime(dt.count());
    total_s += dt.count();
    times.push_back(dt.count());
  }
  const double iters = static_cast<double>(state.iterations());
  const double algbw = total_s > 0 ? static_cast<double>(bytes) * iters / total_s : 0;
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["ranks"] = world;
  state.counters["algbw"] = algbw;
  state.counters["busbw"] = algbw * bus_factor(c, world);
  // The mean hides stalls: a few calls that wait for a busy core dominate it.
  if (!times.empty()) {
    std::sort(times.begin(), times.end());
    state.counters["t_min_us"] = times.front() * 1e6;
    state.counters["t_p50_us"] = times[times.size() / 2] * 1e6;
  }
}

}  // namespace
}  // namespace dtrain::bench

int main(int argc, char** argv) {
  using namespace dtrain::bench;
  return bench_main(argc, argv, [](dtrain::Communicator& comm) {
    const Config cfg;  // from the flags, parsed by now
    const int world = comm.world_size();
    const int64_t align = static_cast<int64_t>(sizeof(float)) * world;
    if (cfg.step < 2) throw std::invalid_argument("--step must be >= 2");
    for (const auto& info : kCollectives) {
      if (("," + cfg.ops + ",").find("," + std::string(info.name) + ",") == std::string::npos) {
        continue;
      }
      for (int64_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes; bytes *= cfg.step) {
        if (bytes % align != 0) {
          if (comm.rank() == 0) {
            std::fprintf(stderr, "skipping %lld bytes: not a multiple of 4 * %d ranks\n",
                         static_cast<long long>(bytes), world);
          }
          continue;
        }
        const std::string name =
            std::string(info.name) + "/ranks:" + std::to_string(world) + "/" + format_bytes(bytes);
        const Collective kind = info.kind;
        register_benchmark(name, comm,
                           [&comm, cfg, kind, bytes, name](benchmark::State& state) {
                             run(state, name, comm, kind, bytes, cfg);
                           })
            ->Iterations(iterations_for(bytes, cfg.target_bytes, cfg.min_iters, cfg.max_iters))
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  });
}

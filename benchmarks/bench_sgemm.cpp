// dtrain_bench_sgemm: fp32 matrix products through LibTorch (at::mm), the operation whose
// speed the BLAS kernel decides. Reports GFLOP/s (2 n^3 per product) per size and intra-op
// thread count, with the BLAS, its kernel and the CPU in the context header, and checks the
// product against an fp64 one (a wrong kernel fails the run: exit status 1).
//
// OpenBLAS picks its kernel when it loads, so kernels are compared run by run:
//   dtrain_bench_sgemm --benchmark_filter='sgemm/n:1024/'
//   OPENBLAS_CORETYPE=Prescott dtrain_bench_sgemm --benchmark_filter='sgemm/n:1024/'
// (docs/blas.md, docs/benchmarks-history.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <atomic>
#include <string>

#include "machine_context.h"

namespace {

std::atomic<bool> g_wrong_result{false};

// Largest |c - a b| relative to the largest |a b|, against an fp64 product.
double relative_error(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  const at::Tensor ref = at::mm(a.to(at::kDouble), b.to(at::kDouble));
  return ((c.to(at::kDouble) - ref).abs().max() / ref.abs().max()).item<double>();
}

void sgemm(benchmark::State& state) {
  const int64_t n = state.range(0);
  at::set_num_threads(static_cast<int>(state.range(1)));
  at::manual_seed(0);
  const at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  at::Tensor c = at::empty({n, n});
  at::mm_out(c, a, b);  // warm-up: thread pool, packing buffers
  for (auto _ : state) {
    at::mm_out(c, a, b);
    benchmark::DoNotOptimize(c.data_ptr<float>());
    benchmark::ClobberMemory();
  }
  // fp32 accumulation over n terms of N(0,1) products: errors far below 1e-4 of the maximum.
  const double err = relative_error(a, b, c);
  state.counters["rel_err"] = err;
  if (!(err < 1e-4)) {
    g_wrong_result = true;
    state.SkipWithError("result differs from the fp64 product");
  }
  // A rate: shown as "GFLOP=<n>/s".
  state.counters["GFLOP"] = benchmark::Counter(2.0 * static_cast<double>(n * n * n) * 1e-9,
                                               benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(sgemm)
    ->ArgNames({"n", "threads"})
    ->ArgsProduct({{256, 512, 1024, 2048}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  dtrain::bench::add_machine_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return g_wrong_result ? 1 : 0;
}

// dtrain_bench_optimizer: one AdamW step over GPT-2's parameter shapes, LibTorch's
// torch::optim::AdamW against dtrain::FusedAdamW (one pass over memory per parameter),
// per intra-op thread count. Two models: GPT-2 `tiny` (4 layers, dim 256, 16.1M
// parameters) and issue 16's shape (8 layers, dim 512, 51.0M), vocab 50257 (the tied
// embedding is most of the memory). Weight decay on, as in gpt2_train.
//
// Memory as gpt2_train runs it: the process applies tune_host_memory() (4 MiB mmap and trim
// thresholds); start it with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 for the huge pages
// gpt2_train requests (the context line `huge_pages` says which). AdamW's temporaries are
// fresh memory each step, so without either it also measures page faults.
//
//   GLIBC_TUNABLES=glibc.malloc.hugetlb=1 dtrain_bench_optimizer
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "dtrain/fused_adamw.h"
#include "dtrain/host_memory.h"
#include "machine_context.h"

namespace {

// GPT-2's parameters (tied head): embeddings, then per block two LayerNorms, the attention
// and MLP weights with their biases, then the final LayerNorm.
std::vector<at::Tensor> gpt2_parameters(int64_t layers, int64_t dim) {
  const int64_t vocab = 50257, context = 128;
  std::vector<std::vector<int64_t>> shapes = {{vocab, dim}, {context, dim}};
  for (int64_t l = 0; l < layers; ++l) {
    for (std::vector<int64_t> s : std::vector<std::vector<int64_t>>{{dim},
                                                                    {dim},
                                                                    {3 * dim, dim},
                                                                    {3 * dim},
                                                                    {dim, dim},
                                                                    {dim},
                                                                    {dim},
                                                                    {dim},
                                                                    {4 * dim, dim},
                                                                    {4 * dim},
                                                                    {dim, 4 * dim},
                                                                    {dim}}) {
      shapes.push_back(s);
    }
  }
  shapes.push_back({dim});
  shapes.push_back({dim});
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) {
    at::Tensor p = at::randn(s).mul_(0.02).requires_grad_(true);
    p.mutable_grad() = at::randn(s).mul_(1e-3);
    params.push_back(p);
  }
  return params;
}

void adamw(benchmark::State& state) {
  const bool small = state.range(0) == 0;
  const bool fused = state.range(1) == 1;
  at::set_num_threads(static_cast<int>(state.range(2)));
  at::manual_seed(0);
  const auto params = small ? gpt2_parameters(4, 256) : gpt2_parameters(8, 512);
  const auto options = torch::optim::AdamWOptions(6e-4).betas({0.9, 0.95}).weight_decay(0.1);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (fused) {
    opt = std::make_unique<dtrain::FusedAdamW>(params, options);
  } else {
    opt = std::make_unique<torch::optim::AdamW>(params, options);
  }
  opt->step();  // state allocated and faulted in outside the timing
  int64_t numel = 0;
  for (const auto& p : params) numel += p.numel();
  for (auto _ : state) {
    opt->step();
    benchmark::ClobberMemory();
  }
  state.counters["Mparams"] = static_cast<double>(numel) * 1e-6;
  // Bytes the one-pass update must move (read p, g, m, v; write p, m, v), as a rate.
  state.counters["GB"] = benchmark::Counter(7.0 * 4.0 * static_cast<double>(numel) * 1e-9,
                                            benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(adamw)
    ->ArgNames({"model", "fused", "threads"})
    ->ArgsProduct({{0, 1}, {0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Before timing anything: one step of each optimizer from the same parameters and gradients
// must give the same parameters (FusedAdamWTest's bound), so a broken fused update cannot
// report a speed-up. `corrupt` (testing hook) perturbs the fused result and must fail.
bool verify(bool corrupt) {
  at::set_num_threads(2);
  at::manual_seed(0);
  const auto reference = gpt2_parameters(1, 64);
  std::vector<at::Tensor> a, b;
  for (const auto& p : reference) {
    for (auto* out : {&a, &b}) {
      at::Tensor q = p.detach().clone().requires_grad_(true);
      q.mutable_grad() = p.grad().clone();
      out->push_back(q);
    }
  }
  const auto options = torch::optim::AdamWOptions(6e-4).betas({0.9, 0.95}).weight_decay(0.1);
  torch::optim::AdamW plain(a, options);
  dtrain::FusedAdamW fused(b, options);
  for (int step = 0; step < 3; ++step) {
    plain.step();
    fused.step();
  }
  if (corrupt) {
    at::NoGradGuard no_grad;
    b.back().view(-1)[0].add_(1e-3);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::allclose(a[i], b[i], /*rtol=*/1e-6, /*atol=*/1e-7)) {
      std::fprintf(stderr,
                   "verification failed: FusedAdamW differs from torch::optim::AdamW on parameter "
                   "%zu (max |diff| %g)\n",
                   i, (a[i] - b[i]).abs().max().item<double>());
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Our own flag, removed before Google Benchmark parses the rest.
  bool corrupt = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--corrupt_for_test") == 0) {
      corrupt = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  if (!verify(corrupt)) return 1;
  dtrain::tune_host_memory();
  benchmark::AddCustomContext("huge_pages",
                              dtrain::malloc_huge_pages_requested() ? "requested" : "no");
  dtrain::bench::add_machine_context();
  const size_t ran = benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (ran == 0) {
    std::fprintf(stderr, "no benchmark matched the filter\n");
    return 1;
  }
  return 0;
}

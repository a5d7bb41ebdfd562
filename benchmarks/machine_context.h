// The machine a single-process benchmark ran on, in Google Benchmark's context header: the
// CPU and its vector features, the active BLAS and kernel, the user's OPENBLAS_CORETYPE and
// the best kernel family for this CPU (docs/blas.md). Every number in docs/benchmarks.md and
// docs/benchmarks-history.md carries these.
#pragma once

#include <benchmark/benchmark.h>

#include "dtrain/blas.h"

namespace dtrain::bench {

inline void add_machine_context() {
  const CpuFeatures cpu = CpuFeatures::detect();
  const auto env = blas_environment_from_env();
  const auto coretype = env.find(kOpenBlasCoretypeEnv);
  benchmark::AddCustomContext("blas", BlasInfo::active().to_string());
  benchmark::AddCustomContext(kOpenBlasCoretypeEnv,
                              coretype == env.end() ? "(unset)" : coretype->second);
  benchmark::AddCustomContext("cpu", cpu.model + ", " + cpu.summary());
  benchmark::AddCustomContext("best_openblas_kernel", best_openblas_kernel(cpu));
}

}  // namespace dtrain::bench

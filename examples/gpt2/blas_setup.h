// The BLAS this process runs and what --blas_kernel does about its kernel, decided in main
// before any rank starts (docs/blas.md), and the CPU's features they were decided on (also
// whether it computes bf16 natively: the run header, the metrics' cpu_bf16_native, the
// --precision bf16 warning).
#pragma once

#include <string>

#include "dtrain/blas.h"

namespace gpt2 {

struct BlasSetup {
  dtrain::CpuFeatures cpu;  // dtrain::cpu_features_from_env(): DTRAIN_HIDE_NATIVE_BF16 applied
  dtrain::BlasInfo info;
  dtrain::BlasKernelPlan plan;
};

BlasSetup blas_setup(dtrain::BlasKernelPolicy policy);

// "OpenBLAS 0.3.21", or the library alone when it reports no version.
std::string blas_label(const dtrain::BlasInfo& b);

}  // namespace gpt2

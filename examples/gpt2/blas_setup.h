// The BLAS this process runs and what --blas_kernel does about its kernel, decided in main
// before any rank starts (docs/blas.md).
#pragma once

#include <string>

#include "dtrain/blas.h"

namespace gpt2 {

struct BlasSetup {
  dtrain::BlasInfo info;
  dtrain::BlasKernelPlan plan;
};

BlasSetup blas_setup(dtrain::BlasKernelPolicy policy);

// "OpenBLAS 0.3.21", or the library alone when it reports no version.
std::string blas_label(const dtrain::BlasInfo& b);

}  // namespace gpt2

#include "blas_setup.h"

namespace gpt2 {

BlasSetup blas_setup(dtrain::BlasKernelPolicy policy) {
  BlasSetup b;
  b.cpu = dtrain::cpu_features_from_env();
  b.info = dtrain::BlasInfo::active();
  b.plan = dtrain::plan_blas_kernel(b.info, b.cpu, dtrain::blas_environment_from_env(), policy);
  return b;
}

std::string blas_label(const dtrain::BlasInfo& b) {
  return b.version.empty() ? b.library : b.library + " " + b.version;
}

}  // namespace gpt2

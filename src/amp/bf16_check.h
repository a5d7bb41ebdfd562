// The library's one place that warns about bf16 compute on a CPU without native bf16
// (dtrain/blas.h: Bf16CpuCheck, bf16_emulation_warning). Callers decide how often: once per
// Autocast (and its copies), once per FullyShardedDataParallel on its rank 0.
#pragma once

#include <string>

#include "dtrain/blas.h"

namespace dtrain::amp {

// TORCH_WARN("dtrain <who>: " + bf16_emulation_warning(cpu)) when check.warn and the CPU
// (check.cpu, or CpuFeatures::detect()) has no native bf16. Returns whether it warned.
bool warn_if_bf16_emulated(const Bf16CpuCheck& check, const std::string& who);

}  // namespace dtrain::amp

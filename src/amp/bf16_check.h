// The library's one place that warns about bf16 compute on a CPU without native bf16
// (dtrain/blas.h: Bf16CpuCheck, bf16_emulation_warning). Callers decide how often: once per
// Autocast (and its copies), once per FullyShardedDataParallel on its rank 0.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "dtrain/blas.h"

namespace dtrain::detail {

// The test seam of Bf16CpuCheck: the CPU it judges instead of CpuFeatures::detect(). Not
// public (include/dtrain): Bf16CpuCheck names this struct a friend.
struct Bf16CpuInjection {
  static void set_cpu(Bf16CpuCheck& check, CpuFeatures cpu) { check.cpu_ = std::move(cpu); }
  static const std::optional<CpuFeatures>& cpu(const Bf16CpuCheck& check) { return check.cpu_; }
};

}  // namespace dtrain::detail

namespace dtrain::amp {

// TORCH_WARN("dtrain <who>: " + bf16_emulation_warning(cpu)) when check.warn and the CPU
// (the injected one, or CpuFeatures::detect()) has no native bf16. Returns whether it warned.
bool warn_if_bf16_emulated(const Bf16CpuCheck& check, const std::string& who);

}  // namespace dtrain::amp

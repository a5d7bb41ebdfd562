#include "cuda_memory.h"

#if GPT2_HAS_C10_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace gpt2 {

std::optional<double> cuda_peak_mib(int device) {
#if GPT2_HAS_C10_CUDA
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  // Index 0 is StatType::AGGREGATE (all pool sizes), in every LibTorch that has the stats.
  return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0);
#else
  (void)device;
  return std::nullopt;
#endif
}

}  // namespace gpt2

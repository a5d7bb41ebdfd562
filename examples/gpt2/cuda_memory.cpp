#include "cuda_memory.h"

#if GPT2_HAS_C10_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#if GPT2_HAS_CUDART
#include <cuda_runtime_api.h>
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

std::optional<int64_t> cuda_total_bytes(int device) {
#if GPT2_HAS_CUDART
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return std::nullopt;
  return static_cast<int64_t>(prop.totalGlobalMem);
#else
  (void)device;
  return std::nullopt;
#endif
}

}  // namespace gpt2

// The caller's stream: where LibTorch queues the kernels that produce a collective's inputs
// and consume its outputs. The NCCL backend orders its own stream after this one on every
// call, and this one after the call on Work::synchronize().
//
// With a LibTorch built with CUDA (DTRAIN_HAS_C10_CUDA, set by CMake when the Torch package
// provides c10_cuda) that is c10's current stream of the device, which a user can change
// with a CUDAStreamGuard. Without it (Debian's CPU-only LibTorch, used to build and test
// here) no LibTorch kernel can run on a GPU anyway, and the legacy default stream is what
// LibTorch itself uses until a user changes streams.
#pragma once

#include <cuda_runtime_api.h>

#if DTRAIN_HAS_C10_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtrain::nccl_backend {

// The calling thread's current stream on `device` (which must be the current device: the
// legacy default stream is per device).
inline cudaStream_t current_stream(int device) {
#if DTRAIN_HAS_C10_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return cudaStreamLegacy;
#endif
}

}  // namespace dtrain::nccl_backend

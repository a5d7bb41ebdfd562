// Helpers of the NCCL backend: CUDA and NCCL status codes as dtrain errors, the dtype and
// reduction maps, owning CUDA handles, and the polling loop that bounds non-blocking NCCL
// calls.
#pragma once

#include <c10/core/ScalarType.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>

#include <fmt/format.h>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"

namespace dtrain::nccl_backend {

using Clock = std::chrono::steady_clock;

// Throws CommError naming the failed call and CUDA's reason.
inline void check_cuda(cudaError_t status, const ErrorContext& ctx, const char* call) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // LibTorch's next launch check must not see our failure
  throw CommError(ctx, fmt::format("{} failed: {} ({})", call, cudaGetErrorString(status),
                                   cudaGetErrorName(status)));
}

// NCCL's reason for `status`, with its detailed last message when there is one.
inline std::string nccl_reason(ncclResult_t status, ncclComm_t comm) {
  std::string reason = ncclGetErrorString(status);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') reason += fmt::format(" ({})", last);
  return reason;
}

// Throws CommError naming the failed call. ncclInProgress is not a failure.
inline void check_nccl(ncclResult_t status, const ErrorContext& ctx, const char* call,
                       ncclComm_t comm = nullptr) {
  if (status == ncclSuccess || status == ncclInProgress) return;
  throw CommError(ctx, fmt::format("{} failed: {}", call, nccl_reason(status, comm)));
}

// NCCL launches on the calling thread's current device, and the legacy default stream is
// per device. The previous device is not restored: switching back to a device this thread
// never used would create a CUDA context on it.
inline void use_device(int device, const ErrorContext& ctx) {
  int current = -1;
  check_cuda(cudaGetDevice(&current), ctx, "cudaGetDevice");
  if (current != device) check_cuda(cudaSetDevice(device), ctx, "cudaSetDevice");
}

// True once everything recorded in `event` ran; throws CommError for a CUDA failure.
inline bool event_reached(cudaEvent_t event, const ErrorContext& ctx) {
  const cudaError_t status = cudaEventQuery(event);
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is recorded as the last error; clear it
    return false;
  }
  check_cuda(status, ctx, "cudaEventQuery");
  return true;
}

// Polls a non-blocking NCCL call that returned `status` until it settles or `deadline`
// passes. Returns the final state: ncclInProgress means the deadline passed.
inline ncclResult_t settle(ncclComm_t comm, ncclResult_t status, Clock::time_point deadline) {
  auto nap = std::chrono::microseconds(10);
  while (status == ncclInProgress) {
    if (Clock::now() >= deadline) return ncclInProgress;
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
    const ncclResult_t query = ncclCommGetAsyncError(comm, &status);
    if (query != ncclSuccess) return query;
  }
  return status;
}

// Joins a non-blocking NCCL communicator of `world_size` ranks, bounded by `join_deadline`.
// A failure aborts what was made (which also ends NCCL's bootstrap, otherwise left waiting
// for the missing ranks) and throws TimeoutError or CommError naming `what`.
inline ncclComm_t init_nonblocking_comm(int world_size, const ncclUniqueId& id, int rank,
                                        Clock::time_point join_deadline, const ErrorContext& ctx,
                                        const std::string& what) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t status = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
  if (comm != nullptr) status = settle(comm, status, join_deadline);
  if (status != ncclSuccess) {
    const std::string reason = nccl_reason(status, comm);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (status == ncclInProgress) {
      throw TimeoutError(ctx, "not every rank joined the " + what + " in time");
    }
    throw CommError(ctx, "ncclCommInitRankConfig (" + what + ") failed: " + reason);
  }
  return comm;
}

// Throws InvalidArgument for dtypes NCCL has no type for (int16, bool, complex, ...).
inline ncclDataType_t nccl_type(c10::ScalarType type, const ErrorContext& ctx) {
  switch (type) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Byte:
      return ncclUint8;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Long:
      return ncclInt64;
    default:
      throw InvalidArgument(ctx, fmt::format("dtype {} is not supported: NCCL has no such type",
                                             c10::toString(type)));
  }
}

// At world size 1 every reduction returns its input, and an average is a sum: ncclSum there,
// because NCCL before 2.29.7 leaves the last elements of a one-rank ncclAvg unwritten when
// input and output differ (NVIDIA/nccl#1950; torch 2.11's NCCL 2.28.9 does, on an H200).
inline ncclRedOp_t nccl_op(ReduceOp op, int world_size) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return world_size == 1 ? ncclSum : ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

struct StreamDeleter {
  void operator()(cudaStream_t s) const { (void)cudaStreamDestroy(s); }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const { (void)cudaEventDestroy(e); }
};
struct DeviceMemoryDeleter {
  void operator()(void* p) const { (void)cudaFree(p); }
};

// cudaStream_t and cudaEvent_t are pointers, so unique_ptr owns them directly. Destroying
// either with work still pending is legal: CUDA frees it once that work ran.
using Stream = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;
using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;
using DeviceMemory = std::unique_ptr<void, DeviceMemoryDeleter>;

// An event on the current device, without timing (cheaper to record and query).
inline Event make_event(const ErrorContext& ctx) {
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), ctx, "cudaEventCreate");
  return Event(e);
}

}  // namespace dtrain::nccl_backend

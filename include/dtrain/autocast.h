// Mixed precision for any strategy: ATen's autocast around the forward pass.
//
// clang-format off
//   const dtrain::Autocast amp{c10::kCPU, c10::kBFloat16};
//   at::Tensor loss = strategy->forward([&] {
//     dtrain::AutocastGuard guard(amp);      // matmuls and linears of this forward in bf16
//     return loss_fn(model->forward(x), y);  // loss_fn should compute in fp32 (see below)
//   });
//   strategy->backward(loss);                // outside the guard, as in PyTorch
// clang-format on
//
// What stays fp32: the parameters (the optimizer steps fp32 master weights; each weight is
// cast to the low dtype once per forward and the cast is cached until the outermost guard
// ends), their gradients (autograd casts the gradient of each cast back to fp32), the
// optimizer state, and every op autocast keeps in fp32 (its fp32 list: losses such as
// cross_entropy and nll_loss on both devices; on CUDA also softmax, layer_norm, ...). The
// residual stream of a pre-LayerNorm transformer stays fp32 because fp32 + bf16 promotes to
// fp32. Cast a low-precision output to fp32 before a loss that autocast does not list.
//
// Works with every strategy because it only changes which kernels the forward runs:
// SingleDevice and DataParallel see fp32 gradients as usual; FullyShardedDataParallel with
// fp32 parameters too (its MixedPrecision::param_dtype is the other way: the gathered
// parameters themselves in bf16). Activation checkpointing (dtrain::checkpoint) re-enters
// the same autocast state for its recompute.
//
// fp16 needs loss scaling against gradient underflow (dtrain/grad_scaler.h); bf16 has fp32's
// range and needs none.
//
// CPU bf16 is fast only on a CPU with native bf16 (avx512_bf16 or AMX-BF16, dtrain/blas.h);
// elsewhere it is emulated and many times slower than fp32. It still runs, and the first
// guard of an Autocast warns once through TORCH_WARN (see Autocast::cpu_check).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <memory>
#include <mutex>
#include <optional>

#include "dtrain/blas.h"

namespace dtrain {

struct Autocast {
  // Autocast{c10::kCPU, c10::kBFloat16}; the other fields keep their defaults.
  explicit Autocast(c10::DeviceType device_type = c10::DeviceType::CPU,
                    c10::ScalarType low_dtype = c10::ScalarType::BFloat16)
      : device(device_type), dtype(low_dtype) {}

  // The device type whose ops are autocast: kCPU or kCUDA (tensors of other devices are not
  // affected).
  c10::DeviceType device;
  // The low-precision dtype: kBFloat16 (CPU and CUDA) or kHalf (CUDA only: LibTorch's CPU
  // autocast supports bf16 only).
  c10::ScalarType dtype;
  // CPU bf16 on a CPU without native bf16: the first AutocastGuard made from this Autocast
  // (or a copy) warns through TORCH_WARN; later guards do not. cpu_check.warn = false: no
  // warning (say it yourself).
  Bf16CpuCheck cpu_check;
  // Shared by copies: the check above runs once per Autocast and its copies, not per forward.
  std::shared_ptr<std::once_flag> checked = std::make_shared<std::once_flag>();
};

// Enables `autocast` on this thread for the guard's scope and restores the previous
// autocast state after it; guards nest. When the outermost guard ends, the cache of weight
// casts is cleared, so the next forward casts the updated weights again. Throws
// InvalidArgument for an unsupported device or dtype (e.g. kHalf on CPU).
class AutocastGuard {
 public:
  explicit AutocastGuard(const Autocast& autocast);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool cpu_, cuda_;
  c10::ScalarType cpu_dtype_, cuda_dtype_;
};

// Throws InvalidArgument naming the problem when `autocast` is not supported.
void check_autocast(const Autocast& autocast);

// The dtype this thread's ops on `device` are autocast to (an AutocastGuard's, or one set
// through ATen), or nullopt when autocast is off for that device type. For code that runs
// its own matmuls (a fused kernel, an out= variant that autocast does not reach) and should
// follow the region it is called in. Device types other than CPU and CUDA: nullopt.
std::optional<c10::ScalarType> autocast_dtype(c10::DeviceType device);

}  // namespace dtrain

#include "dtrain/autocast.h"

#include <string>

#include "amp/bf16_check.h"
#include "compat/autocast.h"
#include "dtrain/errors.h"

namespace dtrain {

void check_autocast(const Autocast& a) {
  const bool cpu = a.device == c10::DeviceType::CPU;
  if (!cpu && a.device != c10::DeviceType::CUDA) {
    throw InvalidArgument(
        ErrorContext{-1, -1, "autocast", -1},
        std::string("autocast supports CPU and CUDA, not ") + c10::DeviceTypeName(a.device));
  }
  if (a.dtype != c10::ScalarType::BFloat16 && a.dtype != c10::ScalarType::Half) {
    throw InvalidArgument(
        ErrorContext{-1, -1, "autocast", -1},
        std::string("autocast dtype must be bf16 or fp16, not ") + c10::toString(a.dtype));
  }
  if (cpu && a.dtype == c10::ScalarType::Half) {
    // 1.13's CPU autocast casts to bf16 only and its CPU matmul kernels lack fp16.
    throw InvalidArgument(ErrorContext{-1, -1, "autocast", -1},
                          "fp16 autocast needs CUDA: LibTorch's CPU autocast and CPU matmul "
                          "kernels support bf16 only (use bf16 on CPU)");
  }
}

namespace {

compat::AutocastState entered(const Autocast& a) {
  check_autocast(a);
  compat::AutocastState s = compat::AutocastState::current();
  if (a.device == c10::DeviceType::CPU) {
    s.cpu = true;
    s.cpu_dtype = a.dtype;
  } else {
    s.cuda = true;
    s.cuda_dtype = a.dtype;
  }
  return s;
}

}  // namespace

AutocastGuard::AutocastGuard(const Autocast& autocast) {
  const compat::AutocastState entering = entered(autocast);
  if (autocast.device == c10::DeviceType::CPU && autocast.dtype == c10::ScalarType::BFloat16 &&
      autocast.checked) {
    std::call_once(*autocast.checked,
                   [&] { amp::warn_if_bf16_emulated(autocast.cpu_check, "autocast"); });
  }
  const compat::AutocastState saved = compat::enter_autocast(entering);
  cpu_ = saved.cpu;
  cuda_ = saved.cuda;
  cpu_dtype_ = saved.cpu_dtype;
  cuda_dtype_ = saved.cuda_dtype;
}

std::optional<c10::ScalarType> autocast_dtype(c10::DeviceType device) {
  const compat::AutocastState s = compat::AutocastState::current();
  if (device == c10::DeviceType::CPU && s.cpu) return s.cpu_dtype;
  if (device == c10::DeviceType::CUDA && s.cuda) return s.cuda_dtype;
  return std::nullopt;
}

AutocastGuard::~AutocastGuard() {
  compat::leave_autocast(compat::AutocastState{cpu_, cuda_, cpu_dtype_, cuda_dtype_});
}

}  // namespace dtrain

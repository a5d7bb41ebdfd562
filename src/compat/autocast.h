// Autocast (ATen's automatic mixed precision) state, read and set in one place: LibTorch 2.4
// added per-device functions (is_autocast_enabled(DeviceType), get_autocast_dtype(DeviceType),
// ...) and deprecated the per-device names of 1.13 (is_cpu_enabled(), ...), which 1.13 to 2.3
// offer alone.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define DTRAIN_AUTOCAST_BY_DEVICE_TYPE 1
#else
#define DTRAIN_AUTOCAST_BY_DEVICE_TYPE 0
#endif

namespace dtrain::compat {

struct AutocastState {
  bool cpu = false, cuda = false;
  c10::ScalarType cpu_dtype = c10::ScalarType::BFloat16;
  c10::ScalarType cuda_dtype = c10::ScalarType::Half;

  static AutocastState current() {
    AutocastState s;
#if DTRAIN_AUTOCAST_BY_DEVICE_TYPE
    s.cpu = at::autocast::is_autocast_enabled(c10::DeviceType::CPU);
    s.cuda = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(c10::DeviceType::CUDA);
#else
    s.cpu = at::autocast::is_cpu_enabled();
    s.cuda = at::autocast::is_enabled();
    s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
    s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
#endif
    return s;
  }
  void apply() const {
#if DTRAIN_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, cpu);
    at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, cuda);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, cpu_dtype);
    at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, cuda_dtype);
#else
    at::autocast::set_cpu_enabled(cpu);
    at::autocast::set_enabled(cuda);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_autocast_gpu_dtype(cuda_dtype);
#endif
  }
};

// Entering and leaving an autocast region. Like Python's torch.autocast, regions count their
// nesting and the outermost one clears ATen's cache of weight casts when it ends: the cache
// is keyed by the fp32 weight, so a cast kept past an optimizer step (which updates the
// weight in place) would feed stale weights to the next forward.
// Enters `state`; returns the state leave_autocast() must restore.
inline AutocastState enter_autocast(const AutocastState& state) {
  AutocastState saved = AutocastState::current();
  state.apply();
  at::autocast::increment_nesting();
  return saved;
}
inline void leave_autocast(const AutocastState& saved) {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  saved.apply();
}

// Enters `state` for a scope and restores the previous state after it.
class AutocastGuard {
 public:
  explicit AutocastGuard(const AutocastState& state) : saved_(enter_autocast(state)) {}
  ~AutocastGuard() { leave_autocast(saved_); }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState saved_;
};

}  // namespace dtrain::compat

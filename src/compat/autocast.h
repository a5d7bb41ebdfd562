// Autocast (ATen's automatic mixed precision) state, read and set in one place: 2.x renamed
// the per-device functions (is_autocast_enabled(DeviceType), ...) and deprecated the 1.13
// names used here, which both releases still provide.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/ScalarType.h>

namespace dtrain::compat {

struct AutocastState {
  bool cpu = false, cuda = false;
  c10::ScalarType cpu_dtype = c10::ScalarType::BFloat16;
  c10::ScalarType cuda_dtype = c10::ScalarType::Half;

  static AutocastState current() {
    AutocastState s;
    s.cpu = at::autocast::is_cpu_enabled();
    s.cuda = at::autocast::is_enabled();
    s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
    s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
    return s;
  }
  void apply() const {
    at::autocast::set_cpu_enabled(cpu);
    at::autocast::set_enabled(cuda);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_autocast_gpu_dtype(cuda_dtype);
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

// unit_call: the three points of a unit's forward the schedule needs, in order: enter (gather,
// order check, forward prefetch), exit (free), hook the output (pre-backward gather).
#include "dtrain/fsdp.h"
#include "fsdp/active.h"
#include "fsdp/schedule.h"

namespace dtrain {
namespace fsdp {
namespace {
thread_local Schedule* t_active = nullptr;
}  // namespace

Schedule* active_schedule() { return t_active; }
void set_active_schedule(Schedule* schedule) { t_active = schedule; }

}  // namespace fsdp

at::Tensor unit_call(torch::nn::Module& module, const std::function<at::Tensor()>& fn) {
  fsdp::Schedule* schedule = fsdp::active_schedule();
  if (schedule == nullptr) return fn();
  const int position = schedule->enter_unit(module);
  if (position < 0) return fn();
  at::Tensor out;
  try {
    out = fn();
  } catch (...) {
    schedule->exit_unit(position, /*threw=*/true);
    throw;
  }
  schedule->exit_unit(position, /*threw=*/false);
  schedule->hook_output(position, out);
  return out;
}

}  // namespace dtrain

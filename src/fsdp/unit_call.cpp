// unit_call: the three points of a unit's forward the schedule needs, in order: enter (gather,
// order check, forward prefetch), exit (free), hook the outputs (pre-backward gather).
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

namespace detail {

void run_unit(torch::nn::Module& module, ParamsInBackward params_in_backward,
              const std::function<void(std::vector<at::Tensor>& outputs)>& fn) {
  std::vector<at::Tensor> outputs;
  fsdp::Schedule* schedule = fsdp::active_schedule();
  const bool reads = params_in_backward == ParamsInBackward::kRead;
  const int position = schedule != nullptr ? schedule->enter_unit(module, reads) : -1;
  if (position < 0) return fn(outputs);
  try {
    fn(outputs);
  } catch (...) {
    schedule->exit_unit(position, /*threw=*/true);
    throw;
  }
  schedule->exit_unit(position, /*threw=*/false);
  if (reads) schedule->hook_outputs(position, outputs);
}

}  // namespace detail
}  // namespace dtrain

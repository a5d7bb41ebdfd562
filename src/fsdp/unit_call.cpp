// unit_call: the three points of a unit's forward the schedule needs, in order: enter (gather,
// order check, forward prefetch), exit (free), hook the outputs (pre-backward gather).
#include <torch/nn/module.h>

#include <fmt/format.h>

#include "compat/torch_compat.h"
#include "dtrain/errors.h"
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

std::string forward_outside_message(const torch::nn::Module& unit, const std::string& unit_name) {
  // "unit 'h.0' (BlockImpl)" where the name is known, else "unit BlockImpl".
  const std::string which =
      unit_name.empty() ? unit.name() : fmt::format("'{}' ({})", unit_name, unit.name());
  return fmt::format(
      "the forward of FSDP unit {} ran outside strategy->forward(): its parameters are sharded "
      "(not gathered) there. Run every forward of an FSDP model through "
      "strategy->forward([&] {{ ... }}) on every rank, evaluation too (with grad mode off, e.g. "
      "under torch::NoGradGuard)",
      which);
}

namespace {

// A parameter FSDP released (sharded): elements but no memory.
bool any_released(const torch::nn::Module& module) {
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (p.defined() && p.numel() > 0 && compat::storage_is_released(p)) return true;
  }
  return false;
}

}  // namespace

}  // namespace fsdp

namespace detail {

void run_unit(torch::nn::Module& module, ParamsInBackward params_in_backward,
              const std::function<void(std::vector<at::Tensor>& outputs)>& fn) {
  std::vector<at::Tensor> outputs;
  fsdp::Schedule* schedule = fsdp::active_schedule();
  const bool reads = params_in_backward == ParamsInBackward::kRead;
  const int position = schedule != nullptr ? schedule->enter_unit(module, reads) : -1;
  if (position < 0) {
    // Not a unit of a running FSDP forward: plain, unless it is some FSDP's sharded unit. No
    // map from modules to FSDPs exists (no global state); a released parameter tells.
    if (schedule == nullptr && fsdp::any_released(module)) {
      throw InvalidArgument(fsdp::forward_outside_message(module, ""));
    }
    return fn(outputs);
  }
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

// The FSDP forward running on this thread, if any: how dtrain::unit_call (and anything else
// that marks where a unit runs) reaches the schedule without process-wide state. Set only
// inside Strategy::forward of a FullyShardedDataParallel, cleared when it ends or throws.
#pragma once

#include <string>

namespace torch::nn {
class Module;
}

namespace dtrain::fsdp {

class Schedule;

Schedule* active_schedule();
void set_active_schedule(Schedule* schedule);

// The error of a unit's forward run outside strategy->forward() (its parameters sharded);
// `unit_name`: its qualified name when known, else empty.
std::string forward_outside_message(const torch::nn::Module& unit, const std::string& unit_name);

}  // namespace dtrain::fsdp

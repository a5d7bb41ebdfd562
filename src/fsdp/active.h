// The FSDP forward running on this thread, if any: how dtrain::unit_call (and anything else
// that marks where a unit runs) reaches the schedule without process-wide state. Set only
// inside Strategy::forward of a FullyShardedDataParallel, cleared when it ends or throws.
#pragma once

namespace dtrain::fsdp {

class Schedule;

Schedule* active_schedule();
void set_active_schedule(Schedule* schedule);

}  // namespace dtrain::fsdp

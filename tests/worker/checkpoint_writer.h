// The "checkpoint_writer" scenario of dtrain_test_worker: a process that saves checkpoints
// and can be made to stop at a named point of its second save, to be killed there.
#pragma once

#include <string>

#include "dtrain/communicator.h"

namespace dtrain::testing {

// Saves steps 1 and 2 into `dir` (keep 2). When `pause_at` names a point of the save
// ("tmp_created", "mid_file", "files_written", "before_rename", "renamed"), the save of
// step 2 creates `dir`/../paused there and sleeps until killed. Returns the exit code.
int checkpoint_writer(const std::string& dir, const std::string& pause_at);

// The same through the public API, on every rank of `comm`: the test transformer under FSDP
// (a unit per block), every parameter element set to the step, saved sharded as steps 1
// and 2. On rank `pause_rank`, the save of step 2 stops at `pause_at` (any point
// save_checkpoint reports), creates `dir`/../paused.<rank> and sleeps until killed.
void sharded_checkpoint_writer(const std::shared_ptr<Communicator>& comm, const std::string& dir,
                               const std::string& pause_at, int pause_rank);

}  // namespace dtrain::testing

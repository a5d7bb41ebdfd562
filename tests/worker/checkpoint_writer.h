// The "checkpoint_writer" scenario of dtrain_test_worker: a process that saves checkpoints
// and can be made to stop at a named point of its second save, to be killed there.
#pragma once

#include <string>

namespace dtrain::testing {

// Saves steps 1 and 2 into `dir` (keep 2). When `pause_at` names a point of the save
// ("tmp_created", "mid_file", "files_written", "before_rename", "renamed"), the save of
// step 2 creates `dir`/../paused there and sleeps until killed. Returns the exit code.
int checkpoint_writer(const std::string& dir, const std::string& pause_at);

}  // namespace dtrain::testing

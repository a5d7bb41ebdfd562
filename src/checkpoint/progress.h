// The test seam of a save: a callback at named points, on every rank "tmp_created",
// "mid_file", "files_written", and on rank 0 "before_rename", "renamed". Tests kill or fault
// a writer there. Not public (include/dtrain): CheckpointOptions names this struct a friend.
// With async (a Checkpointer's background saves) the points after "tmp_created" are called on
// the background thread.
#pragma once

#include <functional>
#include <utility>

#include "dtrain/checkpoint.h"

namespace dtrain::detail {

struct CheckpointProgress {
  using Hook = std::function<void(const char* point)>;
  static void set(CheckpointOptions& options, Hook hook) { options.on_progress_ = std::move(hook); }
  static const Hook& get(const CheckpointOptions& options) { return options.on_progress_; }
};

}  // namespace dtrain::detail

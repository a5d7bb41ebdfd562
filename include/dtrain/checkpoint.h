// Checkpoints: save and load the complete training state under any strategy, and load it
// under any other strategy and world size.
//
//   dtrain::CheckpointOptions o;                       // sharded form, keep the last 2
//   dtrain::TrainingState state;
//   state.step = step;                                 // the LR schedule's position
//   state.values["epoch"] = std::to_string(epoch);     // anything else the loop needs
//   dtrain::save_checkpoint("ckpt", *strategy, &optimizer, state, o);   // every rank
//
//   std::string latest = dtrain::latest_checkpoint("ckpt");            // "" if none
//   if (!latest.empty()) state = dtrain::load_checkpoint(latest, *strategy, &optimizer);
//
// What is saved: every parameter (trainable and frozen) and buffer by qualified name, in
// fp32 master precision for FSDP; the optimizer's per-parameter state (AdamW, Adam, SGD:
// moments, momentum buffers, step counts) and its groups' learning rates; the caller's
// TrainingState; every rank's CPU random generator state; and metadata (format version,
// strategy, sharding, world size, model fingerprint: names, shapes, dtypes).
//
// Two forms. kFull: the state is gathered to rank 0, which writes one file with every tensor
// in its full shape (loadable as plain safetensors). kSharded: every rank writes the
// elements it holds (replicated tensors split between their replicas) into its own file;
// no rank ever holds more than its share. Loading reads, on each rank, only the bytes of
// the elements it holds, from whichever files hold them: a checkpoint written by any
// strategy (single, DDP, FSDP with any sharding) on N ranks loads under any strategy on M
// ranks, FSDP's flat shards and their optimizer state re-sliced.
//
// Guarantees: a checkpoint becomes visible (to latest_checkpoint and load) only once
// complete and durable (temporary directory, fsync, atomic rename); a writer killed at any
// point leaves the previous checkpoints intact; every file has CRC-32C checksums verified
// on load. A missing, truncated, corrupted, foreign or mismatched checkpoint (other model,
// other optimizer, other format version) is refused with a CheckpointError naming the
// file and the problem, before anything is written into the model or optimizer.
// On-disk format and messages: docs/checkpoints.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "dtrain/strategy.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

enum class CheckpointFormat { kFull, kSharded };

// State of the training loop saved alongside the model (rank 0's copy is saved).
struct TrainingState {
  int64_t step = 0;                           // optimizer steps taken; names the checkpoint
  std::map<std::string, at::Tensor> tensors;  // extra named tensors (e.g. an EMA, counters)
  std::map<std::string, std::string> values;  // extra named values (e.g. the data position)
};

struct CheckpointOptions {
  CheckpointFormat format = CheckpointFormat::kSharded;
  // Complete checkpoints kept in the directory (the newest ones); at least 1.
  int keep = 2;
  // Called on every rank at named points of a save: "tmp_created", "mid_file",
  // "files_written", and on rank 0 "before_rename", "renamed". For tests that kill a
  // writer at a given point; leave empty otherwise.
  std::function<void(const char* point)> on_progress;
};

// What a save or load did on this rank.
struct CheckpointStats {
  std::string path;    // the checkpoint directory
  int64_t bytes = 0;   // bytes this rank wrote (save) or read from disk (load)
  double seconds = 0;  // wall time of the call on this rank
};

// Saves the training state into DIR/step_<state.step> (see the header comment). Collective:
// every rank of the strategy calls it with the same arguments; rank 0's `state` is saved.
// `optimizer` may be null (weights only). Throws CheckpointError (I/O) or InvalidArgument
// (an unsupported optimizer, a strategy without state_layout) on every rank.
CheckpointStats save_checkpoint(const std::string& dir, Strategy& strategy,
                                torch::optim::Optimizer* optimizer, const TrainingState& state,
                                const CheckpointOptions& options = {});

// The newest complete checkpoint directory in `dir`, or "" when there is none. Incomplete
// saves (killed writers) are never returned.
std::string latest_checkpoint(const std::string& dir);

struct LoadOptions {
  // Restore each rank's CPU random generator when the world size matches the saved one
  // (otherwise generators are left as they are).
  bool restore_rng = true;
};

// Loads a checkpoint written by save_checkpoint (either form, any strategy, any world size)
// into `strategy` and `optimizer` and returns the saved TrainingState. `optimizer` must be
// of the saved type, built over strategy.parameters(); null skips the optimizer state.
// Every rank calls it; each reads only the bytes it needs. On any CheckpointError nothing
// has been written into the model or optimizer of any rank.
TrainingState load_checkpoint(const std::string& path, Strategy& strategy,
                              torch::optim::Optimizer* optimizer, const LoadOptions& options = {},
                              CheckpointStats* stats = nullptr);

}  // namespace dtrain

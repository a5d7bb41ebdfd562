// Checkpoints: save and load the complete training state under any strategy, and load it
// under any other strategy and world size.
//
// clang-format off
//   dtrain::CheckpointOptions o;                       // sharded form, keep the last 2
//   dtrain::TrainingState state;
//   state.step = step;                                 // the LR schedule's position
//   state.values["epoch"] = std::to_string(epoch);     // anything else the loop needs
//   dtrain::save_checkpoint("ckpt", *strategy, &optimizer, state, o);   // every rank
//
//   dtrain::CheckpointOptions bg;                      // or in the background:
//   bg.async = true;
//   dtrain::Checkpointer ckpt("ckpt", bg);            // one per directory, kept across steps
//   ckpt.save(*strategy, &optimizer, state);           // blocks only for a copy to host memory
//   // ... the training goes on while it writes ...
//   ckpt.wait();                                       // before the end: complete, or throws
//
//   std::string latest = dtrain::latest_checkpoint("ckpt");            // "" if none
//   if (!latest.empty()) state = dtrain::load_checkpoint(latest, *strategy, &optimizer);
// clang-format on
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

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/strategy.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

namespace detail {
struct CheckpointProgress;
}

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
  // Background saves (see Checkpointer): the state is copied to host memory at the call and
  // written by a background thread; the directory written is byte for byte the one a
  // foreground save writes. save_checkpoint refuses it (nothing would report its errors).
  bool async = false;
  // How long rank 0's background thread waits for the other ranks' files before it fails
  // the save (a rank died); at least as long as the slowest rank's write.
  std::chrono::milliseconds async_timeout = std::chrono::minutes(10);
  // With async, the sharded form: the Checkpointer keeps the host copy's buffers after a
  // write and copies the next save into them (when the pieces' sizes and dtypes match), so
  // the step waits for a copy into memory already mapped rather than for the page faults of
  // fresh memory, which cost more than the copy itself. Costs one host copy of this rank's
  // state for the Checkpointer's life. false: the buffers are freed after each write.
  bool keep_host_buffers = true;

 private:
  // Tests stop or fault a save at a named point (src/checkpoint/progress.h).
  friend struct detail::CheckpointProgress;
  std::function<void(const char* point)> on_progress_;
};

// What a save or load did on this rank.
struct CheckpointStats {
  std::string path;    // the checkpoint directory
  int64_t bytes = 0;   // bytes this rank wrote (save) or read from disk (load)
  double seconds = 0;  // wall time of the call on this rank
};
// For a background save, Checkpointer::save returns the time the call blocked (the copy)
// and 0 bytes; Checkpointer::wait returns the bytes written and the background write's time.

// Saves the training state into DIR/step_<state.step> (see the header comment). Collective:
// every rank of the strategy calls it with the same arguments; rank 0's `state` is saved.
// `optimizer` may be null (weights only). Throws CheckpointError (I/O) or InvalidArgument
// (an unsupported optimizer, a strategy without state_layout) on every rank; options.async
// is refused (InvalidArgument: use a Checkpointer).
CheckpointStats save_checkpoint(const std::string& dir, Strategy& strategy,
                                torch::optim::Optimizer* optimizer, const TrainingState& state,
                                const CheckpointOptions& options = {});

// Saves checkpoints into one directory, one at a time: in the foreground (as
// save_checkpoint), or with CheckpointOptions::async in the background.
//
// A background save is collective at the call, like a foreground one: the ranks agree on the
// optimizer state, gather the random generators, and copy what they write to host memory
// (the full form: every tensor gathered whole into rank 0's host memory, so rank 0 needs
// room for the whole model and optimizer state; the sharded form: each rank its share).
// That copy is all the step waits for. A thread per rank then writes the files with the same
// atomic, checksummed layout; rank 0's thread waits for every rank's files (at most
// async_timeout) and makes the checkpoint visible as a foreground save does, without a
// collective, so the checkpoint is complete as soon as the slowest rank has written.
//
// Errors of a background write are never lost: wait() (collective) throws them on every rank
// (a CheckpointError naming the rank, the step and the cause on the rank that failed; "another
// rank failed" on the others), and save() calls wait() first, so a failed write surfaces at
// the next save at the latest. A second save while one is in flight waits for it. The
// destructor waits for the write in flight too (it does not throw: an error nobody waited
// for is printed to stderr); destroyed by an exception, it stops rank 0 waiting for the
// other ranks. Call wait() before the end of training, on every rank.
class Checkpointer {
 public:
  explicit Checkpointer(std::string dir, CheckpointOptions options = {});
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective, between steps (as save_checkpoint). Waits for the previous save (throwing its
  // error), then saves `state.step`: to the end (foreground) or until the copy is taken.
  CheckpointStats save(Strategy& strategy, torch::optim::Optimizer* optimizer,
                       const TrainingState& state);
  // Collective. Until the save in flight is complete and visible; throws its error. Returns
  // its stats (empty when none was in flight).
  CheckpointStats wait();
  // A background save was started and not yet waited for.
  bool in_flight() const;
  const std::string& dir() const { return dir_; }

 private:
  struct Write;
  std::string dir_;
  CheckpointOptions options_;
  std::unique_ptr<Write> write_;
  // The last background save's host copies, reused by the next (keep_host_buffers).
  std::vector<at::Tensor> host_buffers_;
};

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

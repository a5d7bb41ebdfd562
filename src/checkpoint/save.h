// The steps of a save, shared by the foreground save (save_checkpoint) and the background
// one (Checkpointer with CheckpointOptions::async, checkpointer.cpp):
//
//   plan_save   collective, on the caller's thread: what this rank writes (the pieces of
//               layout.h), the ranks' agreement on the optimizer state, every rank's random
//               generators to rank 0, the temporary directory; with `copy`, everything the
//               write needs is copied to host memory (the full form gathered on rank 0), so
//               the model and optimizer may change while the write runs.
//   write_*     the files: this rank's data file and sidecar (sharded), rank 0's
//               model.safetensors (full) and extra.safetensors.
//   commit      rank 0, once every rank's files are written: the manifest, the atomic rename,
//               pruning (directory.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/agreement.h"
#include "dtrain/checkpoint.h"
#include "dtrain/json.h"

namespace dtrain::checkpoint {

// One piece this rank writes: the elements [wb, we) of a tensor (its data, or one kind of
// its optimizer state), 1-D.
struct Piece {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;  // the whole tensor's
  int64_t wb = 0, we = 0;
  at::Tensor data;
};

// What one save writes on one rank.
struct SaveJob {
  std::string dir, tmp;
  int64_t step = 0;
  bool full = false;
  bool copied = false;   // plan_save(copy = true): nothing refers to the live state
  CommunicatorPtr comm;  // the strategy's (null for one rank)
  int rank = 0, world = 1;
  int keep = 2;
  std::function<void(const char*)> on_progress;
  // Sharded: this rank's pieces. Full: the pieces before the gather; once copied, on rank 0
  // every tensor whole (wb = 0, we = numel), on the other ranks none.
  std::vector<Piece> pieces;
  // Rank 0: the caller's tensors and every rank's generators (extra.safetensors), and the
  // manifest without its "files".
  std::vector<std::pair<std::string, at::Tensor>> extra;
  Json manifest;
  Json files = Json::object();  // rank 0: name -> digest + pieces, as files are written
  int64_t bytes = 0;            // written by this rank

  void progress(const char* point) const {
    if (on_progress) on_progress(point);
  }
};

// With copy, the sharded form: piece n is copied into reuse[n] where that is a CPU buffer
// of its dtype and size (a previous save's copy), else into fresh memory.
SaveJob plan_save(const std::string& dir, Strategy& strategy, torch::optim::Optimizer* optimizer,
                  const TrainingState& state, const CheckpointOptions& options, bool copy,
                  const std::vector<at::Tensor>& reuse = {});

// Sharded: this rank's file and its sidecar (published atomically: rank 0 may be waiting
// for it). A copied full-form job writes an empty sidecar on every rank, as its "done".
void write_rank_files(SaveJob& job);
// Full form, not copied (collective): rank 0 receives the pieces tensor by tensor and writes
// model.safetensors; no rank holds more than one full tensor at a time.
void write_full_streaming(SaveJob& job, const Ranks& ranks);
// Full form, copied: rank 0 writes model.safetensors from its host copies.
void write_full_copied(SaveJob& job);
// Rank 0: extra.safetensors.
void write_extra(SaveJob& job);
// Rank 0: merges the sidecars of every rank (when there are any), writes the manifest,
// renames the temporary directory into place and prunes.
void commit(SaveJob& job);

std::string error_file(int rank);  // "rankNNNNN.error": a rank's failed background write

}  // namespace dtrain::checkpoint

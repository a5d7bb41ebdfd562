// Names of a checkpoint's pieces and files, and which elements of a tensor a rank writes.
//
// Keys of the pieces: "model/<name>" for parameters and buffers, "optim/<name>/<kind>" for
// the optimizer state of a parameter (kind: exp_avg, exp_avg_sq, max_exp_avg_sq,
// momentum_buffer), "training/<name>" and the generators ("rng/...", rng_states.h) in
// extra.safetensors. A piece [begin, end) holds those flattened elements of its tensor; the
// full form writes each tensor whole, in its own shape, as one piece [0, numel).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/strategy.h"

namespace dtrain::checkpoint {

// Point-to-point tag of the full form's gather: 0, because NCCL has no tags and refuses any
// other (docs/nccl.md); the gather's sends and receives match in issue order, and nothing
// else sends between steps.
constexpr uint32_t kTag = 0;
constexpr const char* kExtraFile = "extra.safetensors";
constexpr const char* kFullFile = "model.safetensors";

inline const char* kind_name(StateSlice::Kind k) {
  switch (k) {
    case StateSlice::Kind::kParameter:
      return "parameter";
    case StateSlice::Kind::kFrozenParameter:
      return "frozen";
    case StateSlice::Kind::kBuffer:
      return "buffer";
  }
  return "?";
}

inline std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The elements [wb, we) of a slice this rank writes: replicas split a range evenly. A buffer
// is written whole by replica 0 (rank 0): replicas of a buffer can differ (BatchNorm
// statistics, which each rank updates from its own rows after DataParallel's broadcast), and
// a stitch of several ranks' copies would be values no rank ever had. Rank 0's is the copy
// DataParallel broadcasts at the next forward (see keep_rank_buffers for the others').
inline std::pair<int64_t, int64_t> write_range(const StateSlice& s) {
  if (s.kind == StateSlice::Kind::kBuffer) {
    return s.replica == 0 ? std::pair{s.begin, s.end} : std::pair{s.begin, s.begin};
  }
  const int64_t n = s.end - s.begin;
  return {s.begin + n * s.replica / s.num_replicas, s.begin + n * (s.replica + 1) / s.num_replicas};
}

inline std::string model_key(const std::string& name) { return "model/" + name; }
inline std::string optim_key(const std::string& name, const std::string& kind) {
  return "optim/" + name + "/" + kind;
}
inline std::string rank_file(int rank) { return fmt::format("rank{:05d}.safetensors", rank); }
inline std::string sidecar_file(int rank) { return fmt::format("rank{:05d}.json", rank); }

}  // namespace dtrain::checkpoint

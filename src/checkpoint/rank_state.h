// Each rank's own state outside the model (StateLayout::rank_state: a DataParallel comm hook's
// state, e.g. PowerSGD's error feedback and Q), saved for every rank by rank 0 into
// extra.safetensors as "rank_state/<rank>/<name>", and handed back to the same rank on a load
// at the same world size (docs/checkpoints.md, "Per-rank state").
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/safetensors.h"

namespace dtrain {
class Communicator;
}

namespace dtrain::checkpoint {

using NamedTensors = std::map<std::string, at::Tensor>;

// Every rank's state on rank 0 (other ranks get an empty vector), sent point to point to
// rank 0 only: rank 0 holds every rank's state while the checkpoint is written, the others
// only their own. comm null: one rank. Every rank must call it, between steps (nothing else
// may use point-to-point calls on comm meanwhile).
std::vector<NamedTensors> gather_rank_states(Communicator* comm, const NamedTensors& mine);

// Appends rank `rank`'s entries to extra.safetensors' tensor list.
void append_rank_state_entries(int rank, const NamedTensors& state,
                               std::vector<std::pair<std::string, at::Tensor>>& extra);

// Rank `rank`'s saved state; nullopt when the checkpoint has none for it.
std::optional<NamedTensors> read_rank_state_entries(SafetensorsReader& extra, int rank);

// The wire format of one rank's state (exposed for its test): names, dtypes, shapes, bytes.
std::string pack_rank_state(const NamedTensors& state);
NamedTensors unpack_rank_state(const std::string& bytes);

}  // namespace dtrain::checkpoint

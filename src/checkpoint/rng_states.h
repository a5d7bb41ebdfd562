// The random generators a checkpoint saves and restores (docs/checkpoints.md, "Random
// generators"): each rank's CPU generator and one generator per CUDA device its process sees.
// Generators are passed in, so that the rules run in tests with stand-ins, and without a GPU.
//
// extra.safetensors holds, for every rank r:
//   "rng/cpu/<r>"         the CPU generator's state (uint8)
//   "rng/cuda_count/<r>"  int64 [1]: how many CUDA generators follow (0 without a GPU)
//   "rng/cuda/<r>/<d>"    CUDA device d's generator state (uint8), d < cuda_count
// Checkpoints written before CUDA generators were saved have no "rng/cuda_count/<r>": they
// read as zero CUDA generators.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/safetensors.h"

namespace dtrain {
class Communicator;
}

namespace dtrain::checkpoint {

struct Generators {
  at::Generator cpu;
  std::vector<at::Generator> cuda;  // [device]

  // This process's default generators: CPU, and CUDA devices [0, cuda_device_count()).
  static Generators process_defaults();
};

// Generator states: CPU uint8 tensors as at::Generator::get_state returns them.
struct RngStates {
  at::Tensor cpu;
  std::vector<at::Tensor> cuda;  // [device]
};

RngStates capture(const Generators& generators);

// Rank r's states, gathered to rank 0 (every rank's result on rank 0; other ranks get an
// empty vector). comm null: one rank. Every rank must call it.
std::vector<RngStates> gather_rng_states(Communicator* comm, const RngStates& mine);

// Appends rank `rank`'s entries (see above) to extra.safetensors' tensor list.
void append_rng_entries(int rank, const RngStates& states,
                        std::vector<std::pair<std::string, at::Tensor>>& extra);

// Rank `rank`'s saved states; nullopt when the checkpoint has none for it ("rng/cpu/<rank>"
// absent). Throws CheckpointError when "rng/cuda_count/<rank>" names entries that are missing.
std::optional<RngStates> read_rng_entries(SafetensorsReader& extra, int rank);

// What restore() did with the CUDA states.
enum class CudaRestore { kNone, kRestored, kCountDiffers };

// Sets the CPU generator, and the CUDA generators when the checkpoint holds as many as
// `generators` has (device d from state d). When the counts differ (another number of
// visible GPUs; a checkpoint from a machine without one, or from before CUDA states were
// saved, on a machine with GPUs) the CUDA generators are left as they are, as every generator
// is when the world size differs: a state has no counterpart on another device layout.
CudaRestore restore(const Generators& generators, const RngStates& states);

}  // namespace dtrain::checkpoint

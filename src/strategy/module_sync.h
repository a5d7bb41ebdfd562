// Start-of-training agreements shared by the strategies that replicate or shard a module.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"

namespace torch::nn {
class Module;
}

namespace dtrain {

// Checks that every rank has the same tensors (names, dtypes, shapes, in order). On a
// mismatch every rank throws InvalidArgument naming the first difference and the rank that
// has it, so no rank is left waiting. `op` names the caller in the error.
void verify_same_model(Communicator& comm,
                       const std::vector<std::pair<std::string, at::Tensor>>& named,
                       const char* op);

// Overwrites `tensors` on every rank with rank 0's values.
void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors);

// The start of training under a strategy that replicates or shards `module`: every rank has
// the same parameters and buffers (verify_same_model), then rank 0's values are every rank's.
// `broadcast_parameters` false: every rank computes the same initial parameter values itself
// (FSDP's deferred_init), so only the buffers are broadcast.
void agree_on_initial_state(Communicator& comm, torch::nn::Module& module, const char* op,
                            bool broadcast_parameters = true);

}  // namespace dtrain

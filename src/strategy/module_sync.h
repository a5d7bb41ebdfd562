// Start-of-training agreements shared by the strategies that replicate or shard a module.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"

namespace dtrain {

// Checks that every rank has the same tensors (names, dtypes, shapes, in order). On a
// mismatch every rank throws InvalidArgument naming the first difference and the rank that
// has it, so no rank is left waiting. `op` names the caller in the error.
void verify_same_model(Communicator& comm,
                       const std::vector<std::pair<std::string, at::Tensor>>& named,
                       const char* op);

// Overwrites `tensors` on every rank with rank 0's values.
void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors);

}  // namespace dtrain

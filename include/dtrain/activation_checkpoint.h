// Activation checkpointing: run part of a model's forward without keeping its intermediate
// activations, and recompute them during backward. Trades one extra forward of that part for
// the memory of its activations (with every transformer block checkpointed, only the blocks'
// inputs stay alive between forward and backward).
//
// clang-format off
//   x = dtrain::checkpoint([&](const at::Tensor& in) { return block->forward(in); }, x);
// clang-format on
//
// The recompute sees what the first forward saw: the CPU random generator (and those of the
// CUDA devices of the inputs) is restored to its state at the start of the first forward,
// so dropout draws the same masks; autocast is re-entered with the same settings. The
// random streams then continue from where the first forward left them.
//
// Composes with the strategies: under DataParallel the parameters' gradients are accumulated
// by the recompute's backward, so DDP's bucket hooks fire as usual; under
// FullyShardedDataParallel a checkpointed unit is gathered again for the recompute (as it is
// for its backward anyway). The function must be deterministic apart from the random
// generators, and must not modify its inputs in place.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace dtrain {

using CheckpointedFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) without recording its graph; the outputs get a gradient function that
// recomputes fn during backward. Inputs that require grad get their gradients; the
// parameters fn uses get theirs accumulated as in a plain forward. When grad mode is off, or
// nothing requires grad, this is just fn(inputs).
std::vector<at::Tensor> checkpoint(const CheckpointedFn& fn, const std::vector<at::Tensor>& inputs);

// One tensor in, one tensor out (a transformer block).
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input);

}  // namespace dtrain

// FusedAdamW: torch::optim::AdamW whose update of a parameter is one pass over its memory.
//
// LibTorch's AdamW updates each parameter with about ten tensor operations (decay, two
// moment updates, sqrt, two divisions, addcdiv), each a full read and write of the
// parameter-sized tensors and two of them allocating a temporary. FusedAdamW reads the
// parameter, its gradient and both moments once and writes the parameter and moments once,
// split over the intra-op threads (as PyTorch's `AdamW(fused=True)` on CPU).
//
// clang-format off
//   dtrain::FusedAdamW opt(strategy.parameters(), torch::optim::AdamWOptions(3e-4));
// clang-format on
//
// It *is* a torch::optim::AdamW: the same constructors, options (lr, betas, eps,
// weight_decay, amsgrad; per parameter group), state (AdamWParamState: step, exp_avg,
// exp_avg_sq, max_exp_avg_sq), so checkpoints (dtrain::save_checkpoint, torch::save) and
// GradScaler treat both alike and either can resume the other's state. Results equal
// AdamW's up to float rounding (the same formula, evaluated element by element; AdamW's
// vectorized kernels may fuse a multiply-add): FusedAdamWTest compares them within 1e-6
// relative after several steps.
//
// The one-pass update applies to CPU parameters of float or double whose gradient and
// state are contiguous tensors of the same dtype and size (every dtrain strategy's
// parameters: module parameters, FSDP flat shards and their use_orig_params views).
// Parameters on an accelerator (CUDA) with the same properties (any floating dtype) are
// updated together, a fixed number of kernel launches per parameter group, device, dtype
// and step count instead of about ten per parameter: with LibTorch 2.4 or later by
// `_fused_adamw_` (PyTorch's AdamW(fused=True) kernel; results equal AdamW's up to float
// rounding), before that by AdamW's operations as multi-tensor (foreach) kernels. Nothing
// is read on the host. Any other parameter (another dtype, a non-contiguous tensor) is
// updated with AdamW's own sequence of tensor operations. Sparse gradients throw, as in
// AdamW. The state (names, layout, the host step count) is AdamW's on every path.
#pragma once

#include <torch/optim/adamw.h>

namespace dtrain {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  // One AdamW step over every parameter with a gradient (parameters without one are
  // skipped, their step count unchanged). `closure`, when given, is evaluated first with
  // gradients enabled and its loss returned.
  at::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace dtrain

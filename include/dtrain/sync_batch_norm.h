// SyncBatchNorm: batch normalization whose batch statistics are those of the global batch,
// the union of every rank's part of it (PyTorch's torch.nn.SyncBatchNorm).
//
// clang-format off
//   auto model = std::make_shared<torch::nn::SequentialImpl>(
//       torch::nn::Conv2d(3, 16, 3), torch::nn::BatchNorm2d(16), torch::nn::ReLU());
//   dtrain::convert_sync_batch_norm(model, comm);   // before the strategy and the optimizer
//   auto strategy = std::make_shared<dtrain::DataParallel>(model, comm);  // or FSDP
// clang-format on
//
// A drop-in for torch::nn::BatchNorm{1,2,3}d: the same options (BatchNormOptions), the same
// parameters and buffers under the same names (weight, bias, running_mean, running_var,
// num_batches_tracked; so state dicts and checkpoints are interchangeable), the same results
// as that module on the global batch:
//  * Training: the mean and the biased variance the input is normalized with are those of
//    the global batch, per channel (dimension 1), reduced over the communicator's ranks by
//    one all-reduce of 2 * num_features + 1 doubles (element counts, sums, sums of squared
//    deviations). Ranks may hold different numbers of rows, even none: the statistics count
//    elements, they never assume equal parts. running_mean / running_var are updated with
//    the global mean and the unbiased global variance (momentum, or the cumulative average
//    when momentum is unset), identically on every rank; num_batches_tracked counts steps.
//  * Backward: the input's gradient needs two per-channel sums over the global batch (of the
//    output gradient and of its product with the normalized input): one more all-reduce.
//    Like PyTorch's, the input's gradient on each rank is that of the sum of the ranks'
//    losses, and weight / bias get this rank's part of theirs: the strategy's gradient
//    averaging (DataParallel, FSDP) then makes every gradient that of the mean of the ranks'
//    losses. Scale each rank's loss by world_size * local_rows / global_rows for the global
//    batch's mean when ranks hold different numbers of rows.
//  * Evaluation (is_training() false): running statistics when track_running_stats, else
//    this rank's own batch statistics (as PyTorch's SyncBatchNorm); no communication.
//
// Collectives: every rank must run the same SyncBatchNorm training forwards in the same
// order, and the backward of each one whose input requires grad (every rank calls backward()
// through it, as under DataParallel and FSDP anyway). Both exchanges go over `comm`, on its
// device (Communicator::device(), tensors copied there and back), in the order the forward
// and the backward reach them; they can share the strategy's communicator, whose other
// collectives are issued in the same order on every rank. A rank that skips one leaves its
// peers in that all-reduce until the communicator's timeout (TimeoutError), or with
// DesyncError when its next collective differs. Inputs of reduced precision (fp16, bf16) are
// normalized in fp32 and the result cast back, in training and in evaluation, whatever the
// dtypes of the parameters and running statistics (e.g. a bf16 input with fp32 statistics
// under FSDP's MixedPrecision::param_dtype).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>

#include "dtrain/communicator.h"

namespace dtrain {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // `comm`: the ranks whose batches form the global batch; must not be null
  // (InvalidArgument). A world of one rank gives torch::nn::BatchNorm's results.
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, CommunicatorPtr comm);

  // input: [N, C, *] with C == options.num_features() (N may be 0 on some ranks, but in
  // training the global batch needs more than one element per channel); anything else
  // throws InvalidArgument naming the shape, on the calling rank before any collective.
  at::Tensor forward(const at::Tensor& input);

  // Registers the parameters and buffers from `options` and resets them (as BatchNorm).
  void reset() override;
  // weight = 1, bias = 0, and the running statistics reset.
  void reset_parameters();
  // running_mean = 0, running_var = 1, num_batches_tracked = 0.
  void reset_running_stats();
  void pretty_print(std::ostream& stream) const override;

  const CommunicatorPtr& communicator() const { return comm_; }

  torch::nn::BatchNormOptions options;
  // Defined only with options.affine().
  at::Tensor weight;
  at::Tensor bias;
  // Defined only with options.track_running_stats().
  at::Tensor running_mean;
  at::Tensor running_var;
  at::Tensor num_batches_tracked;  // int64 scalar

 private:
  CommunicatorPtr comm_;
};

TORCH_MODULE(SyncBatchNorm);

// Replaces every torch::nn::BatchNorm{1,2,3}d under `module` by a SyncBatchNorm over `comm`
// with the same options, parameters and buffers (values, dtypes, devices, requires_grad
// copied) and training mode, keeping the child's name. Call it before wrapping the model in a
// strategy and before building the optimizer: the new module's parameters are new tensors.
//
// A C++ module calls its children through typed members (`torch::nn::BatchNorm2d bn;`
// `bn->forward(x)`), which no converter can redirect; only entries of a
// torch::nn::Sequential, which runs its entries through type-erased handles, can be
// replaced. A BatchNorm anywhere else (a member, an entry of a ModuleList or ModuleDict)
// makes this throw InvalidArgument naming each one, before anything is changed: construct
// those as dtrain::SyncBatchNorm instead. Returns `module`, or, when `module` itself is a
// BatchNorm, its replacement. A BatchNorm registered in several places is replaced by one
// SyncBatchNorm, shared the same way.
std::shared_ptr<torch::nn::Module> convert_sync_batch_norm(
    std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm);

}  // namespace dtrain

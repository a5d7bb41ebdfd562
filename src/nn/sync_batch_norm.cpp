#include "dtrain/sync_batch_norm.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <torch/nn/init.h>

#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/errors.h"
#include "nn/sync_batch_norm_function.h"

namespace dtrain {

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_,
                                     CommunicatorPtr comm)
    : options(options_), comm_(std::move(comm)) {
  if (!comm_) throw InvalidArgument("SyncBatchNorm: communicator is null");
  if (options.num_features() <= 0) {
    throw InvalidArgument(
        ErrorContext{comm_->rank(), comm_->world_size(), "SyncBatchNorm()", -1},
        fmt::format("num_features must be positive, got {}", options.num_features()));
  }
  reset();
}

// The same registrations as LibTorch's BatchNorm (NormImplBase::reset), so that parameter
// and buffer names, and which of them exist, match.
void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", at::empty({c}));
    bias = register_parameter("bias", at::empty({c}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", at::zeros({c}));
    running_var = register_buffer("running_var", at::ones({c}));
    num_batches_tracked =
        register_buffer("num_batches_tracked", at::scalar_tensor(0, at::TensorOptions(at::kLong)));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  c10::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::nn::init::ones_(weight);
  torch::nn::init::zeros_(bias);
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "dtrain::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << (options.affine() ? "true" : "false")
         << ", track_running_stats=" << (options.track_running_stats() ? "true" : "false")
         << ", world_size=" << comm_->world_size() << ")";
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  const ErrorContext ctx{comm_->rank(), comm_->world_size(), "SyncBatchNorm", -1};
  if (!input.defined()) throw InvalidArgument(ctx, "input is undefined");
  if (input.dim() < 2 || input.size(1) != options.num_features() || !input.is_floating_point()) {
    throw InvalidArgument(
        ctx, fmt::format("expected a floating-point input of shape [N, {}, *], got {} [{}]",
                         options.num_features(), c10::toString(input.scalar_type()),
                         fmt::join(input.sizes(), ", ")));
  }
  if (!is_training()) {
    // What BatchNorm does in evaluation: the running statistics, or without them this
    // rank's batch statistics (as PyTorch's SyncBatchNorm). Nothing to exchange.
    const bool same =
        (!weight.defined() || weight.scalar_type() == input.scalar_type()) &&
        (!running_mean.defined() || running_mean.scalar_type() == input.scalar_type());
    if (same) {
      return at::batch_norm(input, weight, bias, running_mean, running_var,
                            /*training=*/!options.track_running_stats(), /*momentum=*/0.0,
                            options.eps(), at::globalContext().userEnabledCuDNN());
    }
    // Mixed dtypes (e.g. a bf16 input under FSDP's param_dtype with fp32 statistics): computed
    // in the training path's precision (fp32, or fp64 for fp64) and cast back, as training does.
    const auto dtype = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const auto cast = [&](const at::Tensor& t) { return t.defined() ? t.to(dtype) : t; };
    return at::batch_norm(cast(input), cast(weight), cast(bias), cast(running_mean),
                          cast(running_var), /*training=*/!options.track_running_stats(),
                          /*momentum=*/0.0, options.eps(), at::globalContext().userEnabledCuDNN())
        .to(input.scalar_type());
  }
  nn::GlobalBatchStats stats = nn::reduce_batch_stats(input, *comm_);
  // The same verdict on every rank: the count is global.
  if (stats.count <= 1) {
    throw InvalidArgument(
        ctx, fmt::format("expected more than 1 value per channel when training, got {} over "
                         "all ranks (this rank's input is [{}])",
                         stats.count, fmt::join(input.sizes(), ", ")));
  }
  if (options.track_running_stats()) {
    c10::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
    const double factor = options.momentum()
                              ? *options.momentum()
                              : 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
    const double n = static_cast<double>(stats.count);
    const at::Tensor unbiased = stats.var * (n / (n - 1));
    running_mean.copy_(running_mean.to(at::kDouble) * (1 - factor) + stats.mean * factor);
    running_var.copy_(running_var.to(at::kDouble) * (1 - factor) + unbiased * factor);
  }
  return nn::sync_batch_norm(input, weight, bias, stats, options.eps(), comm_);
}

}  // namespace dtrain

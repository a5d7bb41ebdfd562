// The two halves of SyncBatchNorm's training forward (dtrain/sync_batch_norm.h): the global
// batch statistics (one all-reduce), then the normalization as an autograd function whose
// backward reduces the gradient's per-channel sums (one more all-reduce).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtrain/communicator.h"

namespace dtrain::nn {

// Statistics of the global batch per channel: float64, on the input's device.
struct GlobalBatchStats {
  at::Tensor mean;
  at::Tensor var;     // biased: the sum of squared deviations divided by count
  int64_t count = 0;  // elements per channel over every rank (N * spatial, summed)
};

// This rank's element count, sums and sums of squared deviations of `input` ([N, C, *], N
// may be 0), all-reduced over `comm` (through its device) into the global statistics.
// Collective. With count 0 mean and var are NaN.
GlobalBatchStats reduce_batch_stats(const at::Tensor& input, Communicator& comm);

// (input - mean) / sqrt(var + eps) * weight + bias with `stats` (weight / bias undefined: 1 /
// 0), differentiable in input, weight and bias. Backward, when input requires grad, all-
// reduces the per-channel sums of the output gradient and of its product with the
// normalized input over `comm` (collective); weight and bias get this rank's sums.
at::Tensor sync_batch_norm(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& bias, const GlobalBatchStats& stats, double eps,
                           CommunicatorPtr comm);

}  // namespace dtrain::nn

// Multi-tensor (foreach) operations whose availability differs between LibTorch releases:
// one kernel launch for a list of tensors on a GPU where the release has one, else one
// launch per tensor. Either way nothing is read on the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <ATen/ops/full.h>
#include <ATen/ops/max.h>
#include <torch/version.h>

#include <cmath>
#include <cstdint>
#include <vector>

// LibTorch 2.4 has `_fused_adamw_` for CUDA and CPU tensors (2.0 for CUDA only): one
// multi-tensor kernel for the whole update, the kernel of PyTorch's AdamW(fused=True).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#include <ATen/ops/_fused_adamw.h>
#define DTRAIN_HAS_FUSED_ADAMW 1
#else
#define DTRAIN_HAS_FUSED_ADAMW 0
#endif

namespace dtrain::compat {

// tensors[i] *= factor for every i, `factor` a 0-dim tensor on the tensors' device (a clip
// coefficient computed there). _foreach_mul_.Tensor arrived in LibTorch 2.1.
inline void foreach_mul_(const std::vector<at::Tensor>& tensors, const at::Tensor& factor) {
  if (tensors.empty()) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  at::_foreach_mul_(tensors, factor);
#else
  for (const at::Tensor& t : tensors) t.mul_(factor);
#endif
}

// Whether adamw_step_() runs one fused kernel (then its results equal AdamW's sequence of
// tensor operations up to float rounding) or that sequence as foreach operations (bitwise
// equal to it wherever the foreach kernels are the per-tensor ones, as on the CPU).
inline constexpr bool kFusedAdamWKernel = DTRAIN_HAS_FUSED_ADAMW;

struct AdamWStep {
  double lr, beta1, beta2, weight_decay, eps;
  bool amsgrad;
  int64_t step;  // this step's count, from 1
};

// One AdamW step (torch::optim::AdamW's formula) over lists of parameters, gradients and
// moments on one device, of one dtype, all at the same step count. max_exp_avg_sqs is empty
// unless s.amsgrad. A fixed number of kernel launches for the whole list; nothing is read on
// the host.
inline void adamw_step_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& max_exp_avg_sqs, const AdamWStep& s) {
  if (params.empty()) return;
#if DTRAIN_HAS_FUSED_ADAMW
  // The kernel reads each parameter's step count from a float tensor on the device: one
  // fill for all of them, split into 0-dim views by one call (not one select per parameter).
  const at::Tensor steps =
      at::full({static_cast<int64_t>(params.size())}, static_cast<double>(s.step),
               params.front().options().dtype(at::kFloat));
  const std::vector<at::Tensor> state_steps = steps.unbind();
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, s.lr,
                    s.beta1, s.beta2, s.weight_decay, s.eps, s.amsgrad, /*maximize=*/false);
#else
  // torch::optim::AdamW::step's operations, each over the whole list.
  const double bias_correction1 = 1 - std::pow(s.beta1, s.step);
  const double bias_correction2 = 1 - std::pow(s.beta2, s.step);
  if (s.weight_decay != 0) at::_foreach_mul_(params, 1 - s.lr * s.weight_decay);
  at::_foreach_mul_(exp_avgs, s.beta1);
  at::_foreach_add_(exp_avgs, grads, 1 - s.beta1);
  at::_foreach_mul_(exp_avg_sqs, s.beta2);
  at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - s.beta2);
  const std::vector<at::Tensor>* second = &exp_avg_sqs;
  if (s.amsgrad) {
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor out = max_exp_avg_sqs[i];  // shares the state's storage
      at::max_out(out, exp_avg_sqs[i], max_exp_avg_sqs[i]);
    }
    second = &max_exp_avg_sqs;
  }
  std::vector<at::Tensor> denom = at::_foreach_sqrt(*second);
  at::_foreach_div_(denom, std::sqrt(bias_correction2));
  at::_foreach_add_(denom, s.eps);
  at::_foreach_addcdiv_(params, exp_avgs, denom, -(s.lr / bias_correction1));
#endif
}

}  // namespace dtrain::compat

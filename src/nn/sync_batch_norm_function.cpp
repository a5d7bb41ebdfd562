#include "nn/sync_batch_norm_function.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <utility>
#include <vector>

#include "comm/control_plane.h"

namespace dtrain::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// fp16 / bf16 are normalized in fp32 (as LibTorch's batch_norm accumulates); fp32 and fp64
// in their own precision.
c10::ScalarType compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Every dimension but the channels'.
std::vector<int64_t> reduced_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [1, C, 1, ...]: a per-channel vector broadcast against x.
std::vector<int64_t> channel_shape(const at::Tensor& x) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = x.size(1);
  return shape;
}

at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  return v.to(x.scalar_type()).view(channel_shape(x));
}

// What backward needs besides the saved input and weight.
struct Saved : torch::CustomClassHolder {
  CommunicatorPtr comm;
  at::Tensor mean, invstd;  // float64, [C]
  int64_t count = 0;
  // Without affine, weight and bias are empty placeholders: a custom function's inputs must
  // be defined tensors in LibTorch 1.13.
  bool affine = true;
  c10::ScalarType bias_dtype = at::kFloat;
};

struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, c10::intrusive_ptr<Saved> saved) {
    const at::Tensor x = input.to(compute_dtype(input));
    // y = x * scale + shift, per channel, with scale = invstd * weight and shift = bias -
    // mean * scale: one pass over the input.
    at::Tensor scale = saved->affine ? saved->invstd * weight.to(at::kDouble) : saved->invstd;
    at::Tensor shift = -saved->mean * scale;
    if (saved->affine) shift = shift + bias.to(at::kDouble);
    at::Tensor y = at::addcmul(per_channel(shift, x), x, per_channel(scale, x));
    ctx->save_for_backward({input, weight});
    saved->bias_dtype = bias.scalar_type();
    ctx->saved_data["saved"] = c10::IValue::make_capsule(std::move(saved));
    return y.to(input.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list tensors = ctx->get_saved_variables();
    const at::Tensor& input = tensors[0];
    const at::Tensor& weight = tensors[1];
    auto holder = ctx->saved_data["saved"].toCapsule();
    const auto* saved = static_cast<const Saved*>(holder.get());

    const at::Tensor x = input.to(compute_dtype(input));
    const at::Tensor g = grads[0].to(x.scalar_type());
    const std::vector<int64_t> dims = reduced_dims(x);
    const at::Tensor xhat = (x - per_channel(saved->mean, x)) * per_channel(saved->invstd, x);
    const at::Tensor sum_dy = g.sum(dims);
    const at::Tensor sum_dy_xhat = (g * xhat).sum(dims);

    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      // dx = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), means over the global batch.
      const int64_t c = x.size(1);
      const at::Tensor total =
          ControlPlane(*saved->comm)
              .all_reduce(at::cat({sum_dy, sum_dy_xhat}).to(at::kDouble), ReduceOp::kSum)
              .to(input.device());
      const double n = static_cast<double>(saved->count);
      const at::Tensor scale =
          saved->affine ? saved->invstd * weight.to(at::kDouble) : saved->invstd;
      const at::Tensor mean_dy = total.narrow(0, 0, c) / n;
      const at::Tensor mean_dy_xhat = total.narrow(0, c, c) / n;
      grad_input = g * per_channel(scale, x) - xhat * per_channel(scale * mean_dy_xhat, x) -
                   per_channel(scale * mean_dy, x);
      grad_input = grad_input.to(input.scalar_type());
    }
    if (ctx->needs_input_grad(1)) grad_weight = sum_dy_xhat.to(weight.scalar_type());
    if (ctx->needs_input_grad(2)) grad_bias = sum_dy.to(saved->bias_dtype);
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
  }
};

}  // namespace

GlobalBatchStats reduce_batch_stats(const at::Tensor& input, Communicator& comm) {
  c10::NoGradGuard no_grad;
  const at::Tensor x = input.detach().to(compute_dtype(input));
  const int64_t c = x.size(1);
  const int64_t n = c == 0 ? 0 : x.numel() / c;
  // [count, n * mean (C), M2 + n * mean^2 (C)]: sums over ranks. Each rank's mean and M2
  // (sum of squared deviations from its own mean) come from two passes over its input, so
  // the float64 sums lose nothing to cancellation that a plain sum of squares would.
  at::Tensor local = at::zeros({2 * c + 1}, x.options().dtype(at::kDouble));
  local.narrow(0, 0, 1).fill_(static_cast<double>(n));
  if (n > 0) {
    const std::vector<int64_t> dims = reduced_dims(x);
    const at::Tensor mean = x.mean(dims);
    const at::Tensor m2 = (x - mean.view(channel_shape(x))).square().sum(dims);
    const at::Tensor mean64 = mean.to(at::kDouble);
    local.narrow(0, 1, c).copy_(mean64 * static_cast<double>(n));
    local.narrow(0, 1 + c, c).copy_(m2.to(at::kDouble) + mean64.square() * static_cast<double>(n));
  }
  const at::Tensor total = ControlPlane(comm).all_reduce(local, ReduceOp::kSum).to(input.device());
  GlobalBatchStats stats;
  stats.count = std::llround(total[0].item<double>());
  const double count = static_cast<double>(stats.count);
  stats.mean = total.narrow(0, 1, c) / count;
  // Sum of squared deviations from the global mean: the ranks' M2 plus their means' spread.
  const at::Tensor m2 = total.narrow(0, 1 + c, c) - stats.mean.square() * count;
  stats.var = m2.clamp_min(0) / count;
  return stats;
}

at::Tensor sync_batch_norm(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& bias, const GlobalBatchStats& stats, double eps,
                           CommunicatorPtr comm) {
  auto saved = c10::make_intrusive<Saved>();
  saved->comm = std::move(comm);
  saved->mean = stats.mean;
  saved->invstd = (stats.var + eps).rsqrt();
  saved->count = stats.count;
  saved->affine = weight.defined() && bias.defined();
  if (!saved->affine) {
    const at::Tensor none = at::empty({0}, input.options());
    return SyncBatchNormFunction::apply(input, none, none, std::move(saved));
  }
  return SyncBatchNormFunction::apply(input, weight, bias, std::move(saved));
}

}  // namespace dtrain::nn

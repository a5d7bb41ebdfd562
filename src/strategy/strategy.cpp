#include "dtrain/strategy.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <tuple>
#include <unordered_set>

#include "compat/foreach.h"
#include "dtrain/errors.h"

namespace dtrain {

at::Tensor Strategy::grad_norm_tensor() { return at::scalar_tensor(grad_norm(), at::kDouble); }

double Strategy::clip_grad_norm(double max_norm) {
  return clip_grad_norm_tensor(max_norm).item<double>();
}

at::Tensor Strategy::clip_grad_norm_tensor(double max_norm) {
  const at::Tensor norm = grad_norm_tensor();
  c10::NoGradGuard no_grad;
  // Same coefficient as torch::nn::utils::clip_grad_norm_, in double; clamped to 1 instead of
  // tested on the host (1 leaves every gradient bitwise unchanged). On the CPU the 0-dim
  // factor is a scalar as the host double was; a GPU kernel rounds it to the gradient's
  // dtype first, as PyTorch's clip does.
  const at::Tensor coef = at::full({}, max_norm, norm.options()).div_(norm + 1e-6).clamp_max_(1.0);
  coef.nan_to_num_(1.0);  // a NaN norm clips nothing, as the host test `coef < 1` did
  std::map<std::tuple<int, int, at::ScalarType>, std::vector<at::Tensor>> groups;
  for (auto& p : stepped_tensors()) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    groups[{static_cast<int>(g.device().type()), g.device().index(), g.scalar_type()}].push_back(g);
  }
  for (auto& [key, grads] : groups) {
    const c10::Device device = grads.front().device();
    compat::foreach_mul_(grads, device == coef.device() ? coef : coef.to(device));
  }
  return norm;
}

StateLayout Strategy::state_layout() {
  throw InvalidArgument(ErrorContext{rank(), world_size(), "state_layout", -1},
                        "strategy '" + name() + "' does not support checkpoints");
}

int64_t tensor_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) total += static_cast<int64_t>(t.storage().nbytes());
  }
  return total;
}

double squared_norm(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return 0.0;
  const double n = t.norm().item<double>();
  return n * n;
}

at::Tensor squared_norm_sum(const std::vector<at::Tensor>& tensors, c10::Device device) {
  c10::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.numel() != 0) {
      by_dtype[t.scalar_type()].push_back(t);
      device = t.device();
    }
  }
  at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (auto& [dtype, group] : by_dtype) {
    const at::Tensor norms = at::stack(at::_foreach_norm(group)).to(at::kDouble);
    sum.add_(norms.mul(norms).sum());
  }
  return sum;
}

}  // namespace dtrain

#include "dtrain/strategy.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <unordered_set>

#include "dtrain/errors.h"

namespace dtrain {

double Strategy::clip_grad_norm(double max_norm) {
  const double norm = grad_norm();
  // Same coefficient as torch::nn::utils::clip_grad_norm_.
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    c10::NoGradGuard no_grad;
    for (auto& p : stepped_tensors()) {
      if (p.grad().defined()) p.mutable_grad().mul_(coef);
    }
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

}  // namespace dtrain

#include "dtrain/single_device.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>

#include "dtrain/errors.h"
#include "strategy/state_layout.h"

namespace dtrain {

SingleDevice::SingleDevice(std::shared_ptr<torch::nn::Module> module, SingleDeviceOptions options)
    : module_(std::move(module)) {
  if (!module_) throw InvalidArgument(ErrorContext{0, 1, "SingleDevice()", -1}, "module is null");
  module_->to(options.device);
}

void SingleDevice::backward(const at::Tensor& loss) { loss.backward(); }

std::vector<at::Tensor> SingleDevice::parameters() { return module_->parameters(); }
std::vector<NamedParameter> SingleDevice::named_parameters() {
  return module_named_parameters(*module_);
}

double SingleDevice::grad_norm() { return grad_norm_tensor().item<double>(); }

at::Tensor SingleDevice::grad_norm_tensor() {
  std::vector<at::Tensor> grads;
  c10::Device device = c10::kCPU;
  for (const auto& p : module_->parameters()) {
    grads.push_back(p.grad());
    device = p.device();
  }
  return squared_norm_sum(grads, device).sqrt_();
}

int64_t SingleDevice::model_state_bytes(const std::vector<at::Tensor>& optimizer_state) {
  std::vector<at::Tensor> all = optimizer_state;
  for (const auto& p : module_->parameters()) {
    all.push_back(p);
    all.push_back(p.grad());
  }
  return tensor_bytes(all);
}

StateLayout SingleDevice::state_layout() {
  return replicated_state_layout(*module_, nullptr, "single device");
}

}  // namespace dtrain

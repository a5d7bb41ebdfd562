#include "dtrain/single_device.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <cmath>

#include "dtrain/errors.h"
#include "strategy/state_layout.h"
#include "strategy/step_driver.h"

namespace dtrain {

// One rank: the driver's agreements exchange nothing, and a failed step drops its gradients
// as under the distributed strategies.
class SingleDevice::Impl final : public StepParticipant {
 public:
  explicit Impl(std::shared_ptr<torch::nn::Module> module)
      : module_(std::move(module)),
        driver_("SingleDevice", nullptr, StepChecks::kAuto, {}, *this) {}

  torch::nn::Module& module() { return *module_; }
  StepDriver& driver() { return driver_; }
  const StepDriver& driver() const { return driver_; }

  void start_forward(bool /*training*/, bool /*gradient_sync*/) override {}
  void issue_as_peers_do(bool /*training*/, bool /*gradient_sync*/) override {}
  std::exception_ptr run_backward(const at::Tensor& loss, bool /*gradient_sync*/) override {
    try {
      loss.backward();
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }
  void reset_after_failure(bool training) noexcept override {
    if (!training) return;
    c10::NoGradGuard no_grad;
    for (auto& p : module_->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  StepDriver driver_;
};

SingleDevice::SingleDevice(std::shared_ptr<torch::nn::Module> module, SingleDeviceOptions options) {
  if (!module) throw InvalidArgument(ErrorContext{0, 1, "SingleDevice()", -1}, "module is null");
  module->to(options.device);
  impl_ = std::make_unique<Impl>(std::move(module));
}

SingleDevice::~SingleDevice() = default;

void SingleDevice::begin_forward() { impl_->driver().begin_forward(requires_gradient_sync()); }
void SingleDevice::end_forward(at::Tensor& /*output*/) { impl_->driver().end_forward(); }
void SingleDevice::forward_failed(std::exception_ptr error) noexcept {
  impl_->driver().forward_failed(std::move(error));
}
void SingleDevice::backward(const at::Tensor& loss) {
  impl_->driver().backward(loss, requires_gradient_sync());
}
void SingleDevice::finish() { impl_->driver().finish(); }
const StepStats& SingleDevice::last_step_stats() const { return impl_->driver().last_stats(); }

std::vector<at::Tensor> SingleDevice::parameters() { return impl_->module().parameters(); }
std::vector<NamedParameter> SingleDevice::named_parameters() {
  return module_named_parameters(impl_->module());
}

double SingleDevice::grad_norm() { return grad_norm_tensor().item<double>(); }

at::Tensor SingleDevice::grad_norm_tensor() {
  std::vector<at::Tensor> grads;
  c10::Device device = c10::kCPU;
  for (const auto& p : impl_->module().parameters()) {
    grads.push_back(p.grad());
    device = p.device();
  }
  return squared_norm_sum(grads, device).sqrt_();
}

int64_t SingleDevice::model_state_bytes(const std::vector<at::Tensor>& optimizer_state) {
  std::vector<at::Tensor> all = optimizer_state;
  for (const auto& p : impl_->module().parameters()) {
    all.push_back(p);
    all.push_back(p.grad());
  }
  return tensor_bytes(all);
}

StateLayout SingleDevice::state_layout() {
  return replicated_state_layout(impl_->module(), nullptr, "single device");
}

}  // namespace dtrain

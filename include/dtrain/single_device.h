// SingleDevice: the baseline strategy. No communication; same loop and metrics as the
// distributed strategies, so comparisons measure only what distribution adds.
#pragma once

#include <c10/core/Device.h>

#include <memory>

#include "dtrain/strategy.h"

namespace dtrain {

struct SingleDeviceOptions {
  // Where the module lives; the module is moved there at construction.
  c10::Device device = c10::Device(c10::kCPU);
};

class SingleDevice final : public Strategy {
 public:
  explicit SingleDevice(std::shared_ptr<torch::nn::Module> module,
                        SingleDeviceOptions options = {});
  ~SingleDevice() override;

  void backward(const at::Tensor& loss) override;
  std::vector<at::Tensor> parameters() override;
  std::vector<NamedParameter> named_parameters() override;
  double grad_norm() override;
  at::Tensor grad_norm_tensor() override;
  int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state = {}) override;
  StateLayout state_layout() override;
  void finish() override;
  const StepStats& last_step_stats() const override;
  std::string name() const override { return "single"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

 protected:
  void begin_forward() override;
  void end_forward(at::Tensor& output) override;
  void forward_failed(std::exception_ptr error) noexcept override;

 private:
  // The step protocol every strategy runs (src/strategy/step_driver.h), with one rank.
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain

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

  void backward(const at::Tensor& loss) override;
  std::vector<at::Tensor> parameters() override;
  std::vector<NamedParameter> named_parameters() override;
  double grad_norm() override;
  at::Tensor grad_norm_tensor() override;
  int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state = {}) override;
  StateLayout state_layout() override;
  const StepStats& last_step_stats() const override { return stats_; }
  std::string name() const override { return "single"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  StepStats stats_;
};

}  // namespace dtrain

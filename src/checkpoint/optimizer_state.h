// The optimizer state a checkpoint saves, for the optimizers LibTorch ships that checkpoints
// support (AdamW, Adam, SGD): per parameter, the step count and the state tensors named by
// kinds() ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"), and the groups'
// learning rates.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace dtrain::checkpoint {

enum class OptType { kNone, kAdamW, kAdam, kSgd };

struct ParamOptState {
  bool present = false;
  int64_t step = 0;
  std::vector<at::Tensor> tensors;  // one per OptimizerAdapter::kinds, full shape of the param
};

// Reads and writes one optimizer's per-parameter state in a type-independent form. A null
// optimizer gives an inactive adapter; an unsupported one throws InvalidArgument.
class OptimizerAdapter {
 public:
  explicit OptimizerAdapter(torch::optim::Optimizer* opt);

  bool active() const { return type_ != OptType::kNone; }
  const char* type_name() const;
  const std::vector<std::string>& kinds() const { return kinds_; }

  ParamOptState get(const at::Tensor& p) const;
  // Replaces p's state (or removes it when !s.present).
  void set(const at::Tensor& p, ParamOptState s) const;

  std::vector<double> learning_rates() const;
  size_t group_count() const;
  // Callers check the group count first (load_checkpoint refuses a mismatch).
  void set_learning_rates(const std::vector<double>& lrs) const;

 private:
  torch::optim::Optimizer* opt_;
  OptType type_ = OptType::kNone;
  std::vector<std::string> kinds_;
};

}  // namespace dtrain::checkpoint

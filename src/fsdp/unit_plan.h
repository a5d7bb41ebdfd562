// Which parameters form which unit: the wrap policy applied to a module.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "dtrain/fsdp.h"

namespace dtrain::fsdp {

struct UnitPlan {
  std::string name;  // "(root)" or the submodule's qualified name
  const torch::nn::Module* module = nullptr;
  std::vector<at::Tensor> params;  // trainable, in module order
  std::vector<std::string> param_names;
};

// The root unit (the whole module) first, then every submodule `policy` wraps, in module
// order; each trainable parameter belongs to its innermost unit. Frozen parameters belong
// to none. A null policy gives the root unit only.
std::vector<UnitPlan> plan_units(const std::shared_ptr<torch::nn::Module>& module,
                                 const WrapPolicy& policy);

}  // namespace dtrain::fsdp

#include <torch/nn/module.h>

#include "dtrain/fsdp.h"
#include "fsdp/unit_plan.h"

namespace dtrain {

WrapPolicy wrap_modules_named(std::string type_name) {
  return [type_name = std::move(type_name)](const std::string&, const torch::nn::Module& m) {
    return m.name().find(type_name) != std::string::npos;
  };
}

WrapPolicy wrap_by_min_params(int64_t min_params) {
  return [min_params](const std::string&, const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters(/*recurse=*/true)) n += p.numel();
    return n >= min_params;
  };
}

namespace fsdp {

std::vector<UnitPlan> plan_units(const std::shared_ptr<torch::nn::Module>& module,
                                 const WrapPolicy& policy) {
  std::vector<UnitPlan> units(1);
  units[0].name = "(root)";
  units[0].module = module.get();
  std::vector<std::string> prefixes = {""};
  if (policy) {
    for (const auto& item : module->named_modules("", /*include_self=*/false)) {
      if (!policy(item.key(), *item.value())) continue;
      UnitPlan u;
      u.name = item.key();
      u.module = item.value().get();
      units.push_back(std::move(u));
      prefixes.push_back(item.key() + ".");
    }
  }
  // Every trainable parameter belongs to its innermost unit (longest name prefix).
  for (const auto& item : module->named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    size_t best = 0;
    for (size_t k = 1; k < prefixes.size(); ++k) {
      if (item.key().rfind(prefixes[k], 0) == 0 && prefixes[k].size() > prefixes[best].size())
        best = k;
    }
    units[best].params.push_back(item.value());
    units[best].param_names.push_back(item.key());
  }
  return units;
}

}  // namespace fsdp
}  // namespace dtrain

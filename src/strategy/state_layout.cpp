#include "strategy/state_layout.h"

#include <torch/nn/module.h>

#include "dtrain/errors.h"

namespace dtrain {

std::vector<NamedParameter> module_named_parameters(const torch::nn::Module& module) {
  std::vector<NamedParameter> out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    out.push_back(NamedParameter{item.key(), item.value(), item.value().sizes().vec()});
  }
  return out;
}

at::Tensor flat_alias(const at::Tensor& t, const std::string& name) {
  if (!t.is_contiguous()) {
    throw InvalidArgument("checkpoint: tensor '" + name + "' is not contiguous");
  }
  return t.detach().view({-1});
}

StateLayout replicated_state_layout(torch::nn::Module& module, CommunicatorPtr comm,
                                    std::string sharding) {
  StateLayout layout;
  layout.sharding = std::move(sharding);
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->world_size() : 1;
  layout.comm = std::move(comm);
  auto add = [&](const std::string& name, const at::Tensor& t, StateSlice::Kind kind) {
    StateSlice s;
    s.name = name;
    s.kind = kind;
    s.shape = t.sizes().vec();
    s.dtype = t.scalar_type();
    s.begin = 0;
    s.end = t.numel();
    s.data = flat_alias(t, name);
    if (kind == StateSlice::Kind::kParameter) s.stepped = t;
    s.replica = rank;
    s.num_replicas = world;
    layout.slices.push_back(std::move(s));
  };
  for (const auto& item : module.named_parameters(true)) {
    add(item.key(), item.value(),
        item.value().requires_grad() ? StateSlice::Kind::kParameter
                                     : StateSlice::Kind::kFrozenParameter);
  }
  for (const auto& item : module.named_buffers(true)) {
    add(item.key(), item.value(), StateSlice::Kind::kBuffer);
  }
  return layout;
}

}  // namespace dtrain

#include "strategy/state_layout.h"

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <map>
#include <utility>

#include <fmt/format.h>

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

void keep_rank_buffers(StateLayout& layout) {
  if (!layout.comm || layout.comm->world_size() == 1) return;
  std::map<std::string, at::Tensor> targets;
  for (const StateSlice& s : layout.slices) {
    if (s.kind != StateSlice::Kind::kBuffer || s.data.numel() == 0) continue;
    const std::string key = "buffer/" + s.name;
    layout.rank_state[key] = s.data.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    targets.emplace(key, s.data);
  }
  if (targets.empty()) return;
  const int rank = layout.comm->rank();
  const int world = layout.comm->world_size();
  layout.load_rank_state = [previous = std::move(layout.load_rank_state), targets, rank,
                            world](const std::map<std::string, at::Tensor>& state) {
    if (previous) previous(state);
    c10::NoGradGuard no_grad;
    for (const auto& [key, target] : targets) {
      auto it = state.find(key);
      if (it == state.end()) continue;  // saved where buffers were broadcast: rank 0's is right
      if (it->second.numel() != target.numel()) {
        throw InvalidArgument(
            ErrorContext{rank, world, "load_checkpoint", -1},
            fmt::format("the checkpoint's rank state holds {} elements for '{}', the model {}",
                        it->second.numel(), key, target.numel()));
      }
      target.copy_(it->second.reshape({-1}));
    }
  };
}

}  // namespace dtrain

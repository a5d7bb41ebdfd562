#include <torch/nn/module.h>

#include <fmt/format.h>

#include "dtrain/errors.h"
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

HybridGroups make_hybrid_groups(std::shared_ptr<Store> store, int rank, int world_size,
                                int shard_group_size, const CommunicatorOptions& options) {
  const ErrorContext ctx{rank, world_size, "make_hybrid_groups", -1};
  if (shard_group_size < 1 || world_size % shard_group_size != 0) {
    throw InvalidArgument(ctx, fmt::format("shard group size {} does not divide world size {}",
                                           shard_group_size, world_size));
  }
  const int group = rank / shard_group_size;
  const int position = rank % shard_group_size;
  CommunicatorOptions shard = options;
  shard.name = fmt::format("{}/hybrid/shard{}", options.name, group);
  CommunicatorOptions replicate = options;
  replicate.name = fmt::format("{}/hybrid/replicate{}", options.name, position);
  HybridGroups g;
  g.shard_group = make_communicator(store, position, shard_group_size, shard);
  g.replicate_group = make_communicator(store, group, world_size / shard_group_size, replicate);
  return g;
}

CommunicatorPtr make_host_group(std::shared_ptr<Store> store, int rank, int world_size,
                                int local_world_size, const CommunicatorOptions& options) {
  const ErrorContext ctx{rank, world_size, "make_host_group", -1};
  if (local_world_size < 1 || world_size % local_world_size != 0) {
    throw InvalidArgument(ctx, fmt::format("local world size {} does not divide world size {}",
                                           local_world_size, world_size));
  }
  CommunicatorOptions host = options;
  // Not "<name>/host<k>": the world communicator's hierarchical transport (a job across
  // hosts) names its own per-host shared-memory segment so, and the two would read each
  // other's segment keys from the store.
  host.name = fmt::format("{}/host_group{}", options.name, rank / local_world_size);
  return make_communicator(std::move(store), rank % local_world_size, local_world_size, host);
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

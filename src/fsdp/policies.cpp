#include <torch/nn/module.h>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/fsdp.h"

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

}  // namespace dtrain

#include "dtrain/device_mesh.h"

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace dtrain {
namespace {

ErrorContext mesh_ctx(const CommunicatorPtr& world, const char* op) {
  return ErrorContext{world->rank(), world->world_size(), op, -1};
}

}  // namespace

DeviceMesh::DeviceMesh(CommunicatorPtr world) : world_(std::move(world)), shard_(world_) {
  if (!world_) throw InvalidArgument("DeviceMesh: the world communicator is null");
}

DeviceMesh DeviceMesh::create(std::shared_ptr<Store> store, CommunicatorPtr world,
                              DeviceMeshOptions options) {
  if (!world) throw InvalidArgument("DeviceMesh::create: the world communicator is null");
  if (!store) throw InvalidArgument(mesh_ctx(world, "DeviceMesh::create"), "store is null");
  const int rank = world->rank(), size = world->world_size();
  DeviceMesh mesh(world);
  if (options.shard_size != 0) {
    HybridGroups g = make_hybrid_groups(store, rank, size, options.shard_size, options.comm);
    mesh.shard_ = std::move(g.shard_group);
    mesh.replicate_ = std::move(g.replicate_group);
  }
  if (options.local_world_size != 0) {
    mesh.host_ = make_host_group(store, rank, size, options.local_world_size, options.comm);
  }
  return mesh;
}

DeviceMesh DeviceMesh::from_groups(CommunicatorPtr world, CommunicatorPtr shard_group,
                                   CommunicatorPtr replicate_group, CommunicatorPtr host_group) {
  DeviceMesh mesh(std::move(world));
  const ErrorContext ctx = mesh_ctx(mesh.world_, "DeviceMesh");
  const int size = mesh.world_->world_size();
  if (shard_group || replicate_group) {
    if (!shard_group || !replicate_group) {
      throw InvalidArgument(ctx, "a 2-D mesh needs both its shard and its replicate group");
    }
    if (shard_group->world_size() * replicate_group->world_size() != size) {
      throw InvalidArgument(ctx, "shard group size x replicate group size must equal world size");
    }
    mesh.shard_ = std::move(shard_group);
    mesh.replicate_ = std::move(replicate_group);
  }
  if (host_group && size % host_group->world_size() != 0) {
    throw InvalidArgument(ctx, fmt::format("the host group's {} ranks do not divide the world's {}",
                                           host_group->world_size(), size));
  }
  mesh.host_ = std::move(host_group);
  return mesh;
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
  // Not "<name>/host<h>": the world's hierarchical transport keeps its per-host segments
  // under those keys, and across hosts a host group of that name joined the world's segment.
  host.name = fmt::format("{}/host_group{}", options.name, rank / local_world_size);
  return make_communicator(std::move(store), rank % local_world_size, local_world_size, host);
}

}  // namespace dtrain

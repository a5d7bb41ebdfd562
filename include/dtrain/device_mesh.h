// DeviceMesh: how a job's ranks are laid out for sharding, and the groups of that layout,
// made in one place (FSDP2's DeviceMesh, for the layouts dtrain uses).
//
//   rank = replica * shard_size + shard_index     (a 2-D mesh: replicate x shard)
//   host = rank / local_world_size                 (consecutive ranks per host, as launched)
//
// clang-format off
//   // 1-D: shard over every rank (FULL_SHARD, SHARD_GRAD_OP) or replicate (NO_SHARD):
//   dtrain::DeviceMesh flat(world);
//   // 2-D (HYBRID_SHARD): shard inside groups of 8 ranks, replicate across them:
//   dtrain::DeviceMeshOptions o;
//   o.shard_size = 8;
//   o.local_world_size = 8;  // and host groups of 8
//   dtrain::DeviceMesh mesh = dtrain::DeviceMesh::create(store, world, o);
//   dtrain::FullyShardedDataParallel fsdp(model, mesh, fsdp_options);
// clang-format on
//
// Groups connect through the store under names derived from DeviceMeshOptions::comm.name
// (`<name>/hybrid/shard<g>`, `<name>/hybrid/replicate<p>`, `<name>/host_group<h>`), so two
// meshes of one job need distinct names.
#pragma once

#include <memory>

#include "dtrain/communicator.h"
#include "dtrain/store.h"

namespace dtrain {

struct DeviceMeshOptions {
  // Ranks per shard group; 0: a 1-D mesh (every rank shards together). Any other value,
  // which must divide the world size, makes a 2-D mesh (HYBRID_SHARD's), also when it is the
  // world size (one replica).
  int shard_size = 0;
  // Ranks per host (the launcher's LOCAL_WORLD_SIZE); 0: no host groups. Must divide the
  // world size. Host groups serve ReshardAfterForward::kHost and quantised gradients in two
  // levels (dtrain/quantization.h).
  int local_world_size = 0;
  // Options of every group made (timeout, backend, device); `name` prefixes their store keys.
  CommunicatorOptions comm;
};

class DeviceMesh {
 public:
  // A 1-D mesh over `world`: no other groups (it makes none, so it is not collective).
  explicit DeviceMesh(CommunicatorPtr world);
  // The groups of `options` over `world`'s ranks, connected through `store`. Collective:
  // every rank of `world` calls it with the same options. Throws InvalidArgument (on every
  // rank alike) for sizes that do not divide the world.
  static DeviceMesh create(std::shared_ptr<Store> store, CommunicatorPtr world,
                           DeviceMeshOptions options);
  // A mesh of groups made elsewhere (each may be null: none). Checks the sizes multiply to
  // the world's.
  static DeviceMesh from_groups(CommunicatorPtr world, CommunicatorPtr shard_group,
                                CommunicatorPtr replicate_group, CommunicatorPtr host_group);

  const CommunicatorPtr& world() const { return world_; }
  // The ranks this rank shards with: the world on a 1-D mesh.
  const CommunicatorPtr& shard_group() const { return shard_; }
  // The ranks holding the same shard as this one; null on a 1-D mesh.
  const CommunicatorPtr& replicate_group() const { return replicate_; }
  // The ranks of this rank's host; null when the mesh has no host layout.
  const CommunicatorPtr& host_group() const { return host_; }
  // 2 with a replicate dimension (HYBRID_SHARD's mesh), else 1.
  int ndim() const { return replicate_ ? 2 : 1; }

 private:
  DeviceMesh() = default;
  CommunicatorPtr world_, shard_, replicate_, host_;
};

// The groups of a 2-D mesh: shard groups of `shard_group_size` consecutive ranks and
// replicate groups of ranks with the same position in their shard group; connects both
// through `store`. Every rank calls it. DeviceMesh::create makes the same groups.
struct HybridGroups {
  CommunicatorPtr shard_group;
  CommunicatorPtr replicate_group;
};
HybridGroups make_hybrid_groups(std::shared_ptr<Store> store, int rank, int world_size,
                                int shard_group_size, const CommunicatorOptions& options = {});

// The communicator of this rank's host for FsdpOptions::host_group and
// quantized_allreduce_hook's host_group (dtrain/quantization.h), with hosts as
// `local_world_size` consecutive ranks (the launcher's numbering: LOCAL_WORLD_SIZE ranks per
// host); connects through `store` under the name `<options.name>/host_group<h>` (apart from
// the keys of the world communicator's own per-host groups). Every rank calls it. Throws
// InvalidArgument unless local_world_size divides world_size.
CommunicatorPtr make_host_group(std::shared_ptr<Store> store, int rank, int world_size,
                                int local_world_size, const CommunicatorOptions& options = {});

}  // namespace dtrain

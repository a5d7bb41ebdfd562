// FullyShardedDataParallel's training state: gradient norm, memory accounting, state dicts
// and the checkpoint layout (dtrain/checkpoint.h), read from the units' flat parameters.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "comm/control_plane.h"
#include "fsdp/fsdp_impl.h"
#include "strategy/state_layout.h"

namespace dtrain {

at::Tensor FullyShardedDataParallel::Impl::grad_norm() {
  driver_.check_usable("grad_norm");
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    grads.push_back(schedule_->unit(k).flat().shard().grad());
  }
  at::Tensor sq = squared_norm_sum(grads, comm_->device());
  if (const auto& shard = schedule_->comms().shard) {
    // Shards are disjoint and padding holds zeros: the global sum is the sum of the parts.
    // On the communicator's device and without a host read (Work::wait orders streams).
    // Part of the step that backward() ended (StepStats::wire).
    sq = driver_.counting_wire([&] {
      return ControlPlane(*shard).all_reduce(sq.reshape({1}), ReduceOp::kSum).reshape({});
    });
  }
  return sq.sqrt_();
}

int64_t FullyShardedDataParallel::Impl::model_state_bytes(
    const std::vector<at::Tensor>& optimizer_state) {
  std::vector<at::Tensor> all = optimizer_state;
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    const fsdp::FlatParam& f = schedule_->unit(k).flat();
    all.push_back(f.shard());
    all.push_back(f.shard().grad());
    all.push_back(f.full());
    all.push_back(schedule_->unit(k).held_gradient());
    for (size_t i = 0; i < f.num_params(); ++i) {
      all.push_back(f.param(i));  // full's views, or fp32 compute copies of their own
      all.push_back(f.param(i).grad());
    }
  }
  return tensor_bytes(all);
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::Impl::full_state_dict() {
  driver_.check_usable("full_state_dict");
  c10::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& shard_comm = schedule_->comms().shard;
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    const fsdp::FlatParam& f = schedule_->unit(k).flat();
    // Gather the fp32 master shards (not the compute-dtype copy) so nothing is rounded.
    // On full's device (the communicator's), also when the shard is offloaded to the host.
    at::Tensor flat =
        at::empty({f.padded()}, at::TensorOptions().dtype(at::kFloat).device(f.full().device()));
    if (shard_comm) {
      shard_comm->all_gather(flat, f.shard().detach().to(flat.device()))->wait();
    } else {
      flat.copy_(f.shard().detach());
    }
    if (comm_->rank() != 0) continue;
    for (size_t i = 0; i < f.num_params(); ++i) {
      out.emplace_back(
          f.name(i),
          flat.narrow(0, f.offset(i), f.param(i).numel()).view(f.param(i).sizes()).clone());
    }
  }
  if (comm_->rank() == 0) {
    for (const auto& item : module_->named_buffers(true)) {
      auto it = buffer_dtypes_.find(item.key());
      out.emplace_back(item.key(), it == buffer_dtypes_.end() ? item.value().clone()
                                                              : item.value().to(it->second));
    }
    // Module order, as torch::nn::Module::named_parameters lists them.
    std::map<std::string, size_t> position;
    size_t k = 0;
    for (const auto& item : module_->named_parameters(true)) position[item.key()] = k++;
    for (const auto& item : module_->named_buffers(true)) position[item.key()] = k++;
    std::stable_sort(out.begin(), out.end(), [&](const auto& a, const auto& b) {
      return position[a.first] < position[b.first];
    });
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>>
FullyShardedDataParallel::Impl::sharded_state_dict() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    const fsdp::Unit& u = schedule_->unit(k);
    const fsdp::FlatParam& f = u.flat();
    out.emplace_back(u.name() + ".flat_shard", f.shard().detach().clone());
    // [shard rank, shard group size, unpadded numel, padded numel]: enough to reassemble
    // the flat buffer and re-shard it for another world size.
    out.emplace_back(
        u.name() + ".flat_meta",
        at::tensor({int64_t{f.shard_rank()}, int64_t{f.shard_size()}, f.numel(), f.padded()},
                   at::kLong));
    for (size_t i = 0; i < f.num_params(); ++i) {
      out.emplace_back(u.name() + ".param." + f.name(i),
                       at::tensor({f.offset(i), f.param(i).numel()}, at::kLong));
    }
  }
  return out;
}

void FullyShardedDataParallel::Impl::load_sharded_state_dict(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  driver_.check_usable("load_sharded_state_dict");
  auto invalid = [&](const std::string& why) {
    throw InvalidArgument(ctx("load_sharded_state_dict"), why);
  };
  std::map<std::string, at::Tensor> given;
  for (const auto& [name, t] : state) {
    if (!given.emplace(name, t).second) invalid(fmt::format("entry '{}' appears twice", name));
  }
  // Every entry this rank's sharded_state_dict() has must match; checked whole before any
  // shard is written, so a refused load changes nothing.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (shard, loaded values)
  for (const auto& [name, want] : sharded_state_dict()) {
    auto it = given.find(name);
    if (it == given.end()) invalid(fmt::format("entry '{}' is missing", name));
    const at::Tensor got = it->second;  // a handle: the entry is erased below
    const bool shard = name.size() > 11 && name.compare(name.size() - 11, 11, ".flat_shard") == 0;
    if (!got.defined() || got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes() ||
        (!shard && !at::equal(got.to(at::kCPU), want))) {
      invalid(
          fmt::format("entry '{}' differs from this rank's layout (saved with another "
                      "model, wrap policy, sharding or shard group? checkpoints, "
                      "dtrain/checkpoint.h, load across those)",
                      name));
    }
    given.erase(it);
    if (shard) {
      const std::string unit = name.substr(0, name.size() - 11);
      for (size_t k = 0; k < schedule_->num_units(); ++k) {
        if (schedule_->unit(k).name() == unit) {
          copies.emplace_back(schedule_->unit(k).flat().shard(), got);
        }
      }
    }
  }
  if (!given.empty()) {
    invalid(fmt::format("entry '{}' is not one of this rank's FSDP units", given.begin()->first));
  }
  c10::NoGradGuard no_grad;
  for (auto& [shard, values] : copies) shard.copy_(values);
  // The shards changed: no gathered copy may be reused; each is rebuilt at its next use.
  schedule_->reshard_all();
}

StateLayout FullyShardedDataParallel::Impl::state_layout() {
  static constexpr const char* kNames[] = {"full_shard", "shard_grad_op", "no_shard",
                                           "hybrid_shard"};
  StateLayout layout;
  const auto& replicate = schedule_->comms().replicate;
  const int replica = replicate ? replicate->rank() : 0;
  const int replicas = replicate ? replicate->world_size() : 1;
  layout.sharding = fmt::format("fsdp {} (shard group {}, {} replica group(s))",
                                kNames[static_cast<int>(options_.sharding)], shard_size_, replicas);
  layout.comm = comm_;
  // A parameter's slice is where its flat range in the unit meets this rank's shard.
  std::map<std::string, StateSlice> sharded;
  for (size_t k = 0; k < schedule_->num_units(); ++k) {
    const fsdp::FlatParam& f = schedule_->unit(k).flat();
    for (size_t i = 0; i < f.num_params(); ++i) {
      StateSlice s;
      s.name = f.name(i);
      s.shape = f.param(i).sizes().vec();
      s.dtype = at::kFloat;  // the master shards' dtype, whatever the compute dtype
      const auto range = f.shard_range(i);
      s.begin = range.begin;
      s.end = range.end;
      s.data = f.shard().detach().narrow(0, range.shard_offset, s.end - s.begin);
      // The optimizer's state for these elements is kept per view, or in the unit's shard.
      s.stepped = f.param_views() ? f.shard_view(i) : f.shard();
      s.stepped_offset = f.param_views() ? 0 : range.shard_offset;
      s.replica = replica;
      s.num_replicas = replicas;
      sharded.emplace(s.name, std::move(s));
    }
  }
  // Module order; frozen parameters and buffers are not in any unit and held in full.
  StateLayout rest = replicated_state_layout(*module_, comm_, "");
  buffer_copies_.clear();
  for (auto& s : rest.slices) {
    auto cast = buffer_dtypes_.find(s.name);
    if (s.kind == StateSlice::Kind::kBuffer && cast != buffer_dtypes_.end()) {
      // Checkpoints see the original dtype: a copy, written back by state_loaded().
      c10::NoGradGuard no_grad;
      at::Tensor buffer = module_->named_buffers(true)[s.name];
      at::Tensor copy = buffer.to(cast->second).contiguous();
      s.dtype = cast->second;
      s.data = copy.view({-1});
      buffer_copies_.emplace_back(buffer, copy);
    }
    auto it = sharded.find(s.name);
    layout.slices.push_back(it != sharded.end() && s.kind == StateSlice::Kind::kParameter
                                ? std::move(it->second)
                                : std::move(s));
  }
  // FSDP broadcasts buffers only at construction (as PyTorch's FSDP): each rank's own.
  keep_rank_buffers(layout);
  return layout;
}

void FullyShardedDataParallel::Impl::state_loaded() {
  // The shards changed: no gathered copy may be reused; each is rebuilt at its next use.
  schedule_->reshard_all();
  c10::NoGradGuard no_grad;
  for (auto& [buffer, copy] : buffer_copies_) buffer.copy_(copy);
}

}  // namespace dtrain

// One FSDP unit's parameters as a flat, padded buffer sharded over a shard group (FSDP's
// FlatParameter; FSDP2's FSDPParam for a whole group). Pure memory and layout, no
// communication, so it can be tested without a communicator:
//
//   layout  parameter i is elements [offset(i), offset(i) + numel(i)) of the flat buffer of
//           `padded` elements (numel rounded up to a multiple of the shard group size);
//   shard   this rank's fp32 master copy of elements [shard_begin, shard_begin + shard_numel):
//           a leaf tensor the optimizer steps;
//   full    the whole flat buffer in the compute dtype; the module's parameter tensors are
//           views into it (set_data at construction), so gathering into `full` is what makes
//           the module's parameters current;
//   release / refill  free full's memory between uses while keeping its storage object, which
//           the parameter views and autograd's saved tensors share: once refilled (and
//           gathered into), they all see the data again;
//   shard views (param_views) each parameter's part of the shard as a 1-D leaf of its own,
//           sharing the shard's memory, with a .grad sharing the shard's gradient: what an
//           optimizer with per-parameter groups steps instead of the shard.
//
// With one shard (no shard group) and fp32 compute, `shard` and `full` are the same memory:
// the optimizer's update is the module's parameter, and nothing is ever released.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/deferred_init.h"
#include "fsdp/buffer_pool.h"

namespace dtrain::fsdp {

struct FlatParamOptions {
  int shard_size = 1;                                    // ranks the flat buffer is sharded over
  int shard_rank = 0;                                    // this rank's position among them
  c10::ScalarType param_dtype = c10::ScalarType::Float;  // dtype of `full` (compute)
  // The optimizer steps shard_view(i) (FsdpOptions::use_orig_params), not shard(): the
  // views' .grad are then the gradient add_to_shard_grad() adds to.
  bool param_views = false;
  // Where full's memory comes from and goes between uses (buffer_pool.h); null: the
  // storage's allocator. Must outlive the FlatParam.
  BufferPool* pool = nullptr;
  // CPU offload (FsdpOptions::cpu_offload): the fp32 shard (and so its gradient and the
  // optimizer's state) in host memory, pinned when the parameters are on a CUDA device,
  // while full stays on the parameters' device; gather_input() copies the shard there and
  // add_to_shard_grad() copies the reduced gradient back. No effect for parameters on the
  // CPU (the shard is in host memory already).
  bool offload = false;
  // Deferred initialisation (dtrain/deferred_init.h): the shard's values are computed from
  // each parameter's initial_value (only the parameters it overlaps, one at a time), the
  // parameters' own memory (deferred or not) is neither read nor kept, and full starts
  // released. Null: the parameters' current values. Must outlive the constructor call.
  const DeferredInit* init = nullptr;
  // Per parameter (empty: none): parameter i computes in fp32 although param_dtype is lower,
  // from a copy of its own that every gather refreshes from full (refresh_fp32_copies()),
  // holding param_dtype's rounding of the master value. For BatchNorm, whose fp32 running
  // statistics need fp32 weight and bias next to a low-precision input.
  std::vector<char> fp32_compute = {};
};

class FlatParam {
 public:
  // Flattens `params` (in this order) and makes each of them a view into full(). The
  // parameters' current values become the shard's (fp32) and full's contents; with
  // options.init, their initial values (by `names`) become the shard's, and full is released
  // (sharded) or filled from the shard when it is first gathered.
  FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names,
            FlatParamOptions options);

  // --- layout ---
  size_t num_params() const { return params_.size(); }
  const at::Tensor& param(size_t i) const { return params_[i]; }
  at::Tensor& param(size_t i) { return params_[i]; }
  const std::string& name(size_t i) const { return names_[i]; }
  int64_t offset(size_t i) const { return offsets_[i]; }
  int64_t numel() const { return numel_; }    // sum of the parameters' sizes
  int64_t padded() const { return padded_; }  // numel rounded up to the shard group size
  int64_t shard_numel() const { return padded_ / options_.shard_size; }
  int64_t shard_begin() const { return options_.shard_rank * shard_numel(); }
  int shard_size() const { return options_.shard_size; }
  int shard_rank() const { return options_.shard_rank; }
  c10::ScalarType param_dtype() const { return options_.param_dtype; }

  // Parameter i's part of this rank's shard: [begin, end) of its own flattened elements,
  // stored at shard element `shard_offset`. Empty (begin == end) when the shard holds none.
  struct ShardRange {
    int64_t begin = 0, end = 0, shard_offset = 0;
  };
  ShardRange shard_range(size_t i) const;

  // --- memory ---
  // fp32 master shard, a leaf (requires grad) that the optimizer steps.
  const at::Tensor& shard() const { return shard_; }
  // The flat buffer in the compute dtype, `padded` elements; no memory while released.
  const at::Tensor& full() const { return full_; }
  // Whether shard() and full() are one memory (one shard, fp32 compute, no offload).
  bool shares_memory() const { return shares_memory_; }

  bool released() const;
  // Bytes of full's memory when it holds data.
  size_t full_bytes() const;
  // Frees full's memory. The storage object stays, so the parameter views keep pointing at
  // it. No effect with one shard: an unsharded configuration keeps its memory.
  void release();
  // Gives full memory again when released; contents undefined until gathered into or
  // copied from the shard.
  void refill();
  // After full received the gathered parameters: the fp32 compute copies
  // (FlatParamOptions::fp32_compute) take their values from it, without touching the
  // parameters' version counters.
  void refresh_fp32_copies();
  // Bumps the parameters' version counters, as an in-place write would: autograd then refuses
  // (with its "modified by an inplace operation" error) to use a parameter it saved before,
  // instead of reading it from released memory.
  void bump_param_versions();

  // param_views: parameter i's part of the shard (shard_range(i)) as a 1-D leaf tensor that
  // requires grad and shares shard()'s memory, so an optimizer step on it updates the shard
  // in place; empty when the shard holds none of parameter i. The same tensor on every call
  // (optimizers key their state by tensor).
  const at::Tensor& shard_view(size_t i) const;
  bool param_views() const { return options_.param_views; }

  // Adds `reduced` (the averaged shard gradient, shard_numel elements, fp32, on full's
  // device; copied to host memory first when offloaded) to the gradient the optimizer sees.
  // Without param_views: shard()'s .grad (created when undefined). With them, the views'
  // .grad are that gradient, whatever the caller did to them since the last step (left
  // them, zeroed them in place, reset them to undefined as LibTorch 2.x's zero_grad() does):
  // their sum with `reduced` becomes shard()'s .grad and every view's .grad shares its
  // memory again.
  void add_to_shard_grad(const at::Tensor& reduced);
  // param_views: drops shard()'s .grad once no view's .grad shares its memory (the optimizer
  // reset them to undefined or replaced them), so a reset gradient frees its memory for the
  // next forward and backward as it does without views. Called when a step begins.
  void release_unshared_shard_grad();
  // A failed step: the gradient the optimizer sees becomes zero (shard()'s and the views').
  void zero_shard_grad();

  // What this rank contributes to the all-gather of full: the shard in the compute dtype,
  // on full's device.
  at::Tensor gather_input() const;
  // Without a shard group: full = the shard in the compute dtype (no copy when shared).
  void copy_shard_to_full();
  // full = `values` (`padded` elements in the compute dtype), without touching the
  // parameters' version counters.
  void copy_into_full(const at::Tensor& values);

  // The parameters' gradients flattened into a new zero-padded buffer of `padded` elements
  // in `dtype` (parameters without a gradient contribute zeros); the parameters' .grad are
  // cleared (the unsharded gradient is not kept). A unit of one parameter that fills the
  // buffer gets its gradient itself back, flattened, when it is contiguous and of `dtype` (no
  // second copy of a large gradient; the caller must not write to it).
  at::Tensor take_grads(c10::ScalarType dtype);
  // Adds the parameters' gradients to `sum` (fp32, `padded` elements, created as zeros when
  // undefined) and clears them: gradient accumulation without communication.
  void add_grads_to(at::Tensor& sum);

 private:
  // views_[i]'s .grad is its part of shard()'s .grad (shares the memory at its offset).
  bool view_shares_grad(size_t i) const;
  // options_.init: this rank's fp32 shard from the parameters' initial values.
  at::Tensor initial_shard(c10::Device device) const;
  FlatParamOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<int64_t> offsets_;
  int64_t numel_ = 0, padded_ = 0;
  at::Tensor full_;
  at::Tensor shard_;
  std::vector<at::Tensor> views_;  // param_views only: one per parameter
  // FlatParamOptions::fp32_compute: per parameter its fp32 copy (undefined for the others),
  // released and refilled with full.
  std::vector<at::Tensor> fp32_copies_;
  bool shares_memory_ = false;
  bool offloaded_ = false;
};

}  // namespace dtrain::fsdp

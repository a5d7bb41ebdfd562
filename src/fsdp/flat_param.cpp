#include "fsdp/flat_param.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "compat/torch_compat.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"

namespace dtrain::fsdp {
namespace {

// Elements [offset, offset + n) of `flat` as a tensor of its own sharing flat's memory, not
// an autograd view (narrow() would be one): optimizers detach_() a .grad in place, which
// autograd refuses on views.
at::Tensor alias(const at::Tensor& flat, int64_t offset, int64_t n) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, {n}, {1});
  return t;
}

// Host memory for an offloaded shard: pinned when the parameters live on a CUDA device, so
// that the copies to and from it can run as DMA transfers.
at::Tensor host_copy(const at::Tensor& t, c10::Device device) {
  at::Tensor host = t.device().is_cpu() ? t.clone() : t.to(at::kCPU);
  return device.is_cuda() ? host.pin_memory() : host;
}

}  // namespace

FlatParam::FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names,
                     FlatParamOptions options)
    : options_(options), params_(std::move(params)), names_(std::move(names)) {
  if (options_.shard_size < 1 || options_.shard_rank < 0 ||
      options_.shard_rank >= options_.shard_size) {
    throw InvalidArgument("FlatParam: shard rank must be in [0, shard size)");
  }
  if (names_.size() != params_.size()) {
    throw InvalidArgument("FlatParam: one name per parameter");
  }
  c10::NoGradGuard no_grad;
  for (const auto& p : params_) {
    offsets_.push_back(numel_);
    numel_ += p.numel();
  }
  // At least one element, so that every unit has a shard (and a collective) on every rank.
  padded_ = padded_size(std::max<int64_t>(numel_, 1), options_.shard_size);
  if (options_.pool != nullptr && options_.shard_size > 1) options_.pool->add_user(full_bytes());
  const auto device = params_.empty() ? c10::Device(c10::kCPU) : params_.front().device();
  offloaded_ = options_.offload && !device.is_cpu();
  shares_memory_ = !offloaded_ && options_.shard_size == 1 && options_.param_dtype == at::kFloat;
  if (options_.init != nullptr && !shares_memory_) {
    // Only this rank's shard is ever computed (in host memory when offloaded). full is not
    // touched before its first gather, so no memory is faulted in for it.
    shard_ = offloaded_ ? host_copy(initial_shard(c10::Device(c10::kCPU)), device)
                        : initial_shard(device);
    full_ = at::empty({padded_}, at::TensorOptions().dtype(options_.param_dtype).device(device));
  } else {
    at::Tensor flat32;
    if (options_.init != nullptr) {
      flat32 = initial_shard(device);  // one shard: the whole unit
    } else {
      flat32 = at::zeros({padded_}, at::TensorOptions().dtype(at::kFloat).device(device));
      for (size_t i = 0; i < params_.size(); ++i) {
        flat32.narrow(0, offsets_[i], params_[i].numel()).copy_(params_[i].reshape({-1}));
      }
    }
    if (shares_memory_) {
      // The master copy and the module's parameters are the same memory: the optimizer's
      // update needs no copy, and keeping two would cost more than DataParallel.
      full_ = flat32;
      shard_ = at::empty({0}, flat32.options());
      shard_.set_(flat32.storage(), 0, {padded_}, {1});
    } else {
      at::Tensor mine = flat32.narrow(0, shard_begin(), shard_numel());
      shard_ = offloaded_ ? host_copy(mine, device) : mine.clone();
      full_ = flat32.to(options_.param_dtype).clone();  // a storage of its own
    }
  }
  shard_.requires_grad_(true);
  fp32_copies_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    const bool own = i < options_.fp32_compute.size() && options_.fp32_compute[i] != 0 &&
                     options_.param_dtype != at::kFloat;
    if (own) {
      fp32_copies_[i] = at::empty(p.sizes(), full_.options().dtype(at::kFloat));
      p.set_data(fp32_copies_[i]);
    } else {
      p.set_data(full_.narrow(0, offsets_[i], p.numel()).view(p.sizes()));
    }
  }
  refresh_fp32_copies();
  if (options_.param_views) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const ShardRange r = shard_range(i);
      views_.push_back(alias(shard_.detach(), r.shard_offset, r.end - r.begin));
      views_.back().requires_grad_(true);
    }
  }
  // The views exist (a view of a released storage could not be made): now free full until
  // its first gather, as a resharded unit is.
  if (options_.init != nullptr) release();
}

at::Tensor FlatParam::initial_shard(c10::Device device) const {
  at::Tensor shard32 =
      at::zeros({shard_numel()}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardRange r = shard_range(i);
    if (r.end == r.begin) continue;  // another rank's: never computed here
    const at::Tensor value = initial_value(*options_.init, names_[i], params_[i].sizes());
    shard32.narrow(0, r.shard_offset, r.end - r.begin)
        .copy_(value.reshape({-1}).narrow(0, r.begin, r.end - r.begin));
  }
  return shard32;
}

const at::Tensor& FlatParam::shard_view(size_t i) const {
  if (!options_.param_views) {
    throw InvalidArgument("FlatParam: shard views exist only with param_views");
  }
  return views_.at(i);
}

FlatParam::ShardRange FlatParam::shard_range(size_t i) const {
  const int64_t begin = shard_begin(), end = begin + shard_numel();
  const int64_t off = offsets_[i], n = params_[i].numel();
  const int64_t lo = std::max(off, begin), hi = std::min(off + n, end);
  if (hi <= lo) return {};
  return ShardRange{lo - off, hi - off, lo - begin};
}

bool FlatParam::released() const { return compat::storage_is_released(full_); }

void FlatParam::release() {
  // One shard: the memory is kept (it is the whole model's copy on this rank either way);
  // the next copy_shard_to_full() refreshes it.
  if (options_.shard_size == 1 || released()) return;
  at::DataPtr memory = compat::take_storage(full_);
  if (options_.pool != nullptr) options_.pool->give(std::move(memory), full_bytes());
  for (const at::Tensor& c : fp32_copies_) {
    if (c.defined()) compat::take_storage(c);
  }
}

void FlatParam::refill() {
  if (!released()) return;
  c10::Allocator& allocator = compat::storage_allocator(full_);
  compat::fill_storage(full_,
                       options_.pool != nullptr ? options_.pool->take(allocator, full_bytes())
                                                : allocator.allocate(full_bytes()),
                       full_bytes());
  for (const at::Tensor& c : fp32_copies_) {
    if (!c.defined()) continue;
    const size_t bytes = static_cast<size_t>(c.numel()) * sizeof(float);
    compat::fill_storage(c, compat::storage_allocator(c).allocate(bytes), bytes);
  }
}

void FlatParam::refresh_fp32_copies() {
  if (released()) return;
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < fp32_copies_.size(); ++i) {
    if (!fp32_copies_[i].defined()) continue;
    // variable_data(): an alias with a version counter of its own (autograd may have saved
    // the parameter in a forward whose backward is still to come).
    fp32_copies_[i].variable_data().copy_(
        full_.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()));
  }
}

size_t FlatParam::full_bytes() const {
  return static_cast<size_t>(padded_) * c10::elementSize(options_.param_dtype);
}

void FlatParam::add_to_shard_grad(const at::Tensor& reduced) {
  c10::NoGradGuard no_grad;
  const at::Tensor here = offloaded_ ? reduced.to(shard_.device()) : reduced;
  at::Tensor& grad = shard_.mutable_grad();
  if (!options_.param_views) {
    if (grad.defined()) {
      grad.add_(here);
    } else {
      grad = here.clone();
    }
    return;
  }
  // The views' gradients still share the shard's: add in place (the usual step, and after an
  // in-place zero_grad()).
  bool all_shared = grad.defined();
  for (size_t i = 0; all_shared && i < views_.size(); ++i) all_shared = view_shares_grad(i);
  if (all_shared) {
    grad.add_(here);
    return;
  }
  // Some view's .grad was reset or replaced: the views hold the gradient so far (a view
  // still sharing the old gradient keeps its memory alive). Padding and elements of no
  // parameter stay what the reduction made them (zeros).
  grad = at::Tensor();
  at::Tensor fresh = here.clone();
  for (size_t i = 0; i < views_.size(); ++i) {
    const at::Tensor& g = views_[i].grad();
    if (g.defined() && g.numel() != views_[i].numel()) {
      throw InvalidArgument("FSDP: the gradient of '" + names_[i] + "' has " +
                            std::to_string(g.numel()) + " elements, its shard view " +
                            std::to_string(views_[i].numel()));
    }
    if (g.defined() && g.numel() > 0) {
      fresh.narrow(0, shard_range(i).shard_offset, g.numel()).add_(g.reshape({-1}));
    }
  }
  grad = fresh;
  for (size_t i = 0; i < views_.size(); ++i) {
    views_[i].mutable_grad() = alias(grad, shard_range(i).shard_offset, views_[i].numel());
  }
}

bool FlatParam::view_shares_grad(size_t i) const {
  const at::Tensor& grad = shard_.grad();
  const at::Tensor& g = views_[i].grad();
  return grad.defined() && g.defined() && g.is_alias_of(grad) &&
         g.storage_offset() == grad.storage_offset() + shard_range(i).shard_offset &&
         g.numel() == views_[i].numel();
}

void FlatParam::release_unshared_shard_grad() {
  if (!options_.param_views || !shard_.grad().defined()) return;
  for (size_t i = 0; i < views_.size(); ++i) {
    const at::Tensor& g = views_[i].grad();
    if (g.defined() && g.numel() > 0 && g.is_alias_of(shard_.grad())) return;  // still used
  }
  shard_.mutable_grad().reset();
}

void FlatParam::zero_shard_grad() {
  c10::NoGradGuard no_grad;
  if (shard_.grad().defined()) shard_.mutable_grad().zero_();
  for (auto& v : views_) {
    if (v.grad().defined()) v.mutable_grad().zero_();
  }
}

at::Tensor FlatParam::gather_input() const {
  c10::NoGradGuard no_grad;
  return shard_.detach().to(full_.device(), options_.param_dtype);
}

void FlatParam::copy_shard_to_full() {
  c10::NoGradGuard no_grad;
  copy_into_full(gather_input());
}

void FlatParam::copy_into_full(const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  const at::Tensor input = values.contiguous();
  if (input.numel() != padded_ || input.scalar_type() != options_.param_dtype) {
    throw InvalidArgument("FlatParam: copy_into_full needs the padded buffer in the compute dtype");
  }
  // The parameters' version counters must not change (autograd would refuse the saved
  // views in backward): a raw copy on the CPU, elsewhere an ATen copy into variable_data(),
  // an alias with a version counter of its own (a host memcpy cannot read device memory).
  if (full_.data_ptr() == input.data_ptr()) return;
  if (full_.is_cpu() && input.is_cpu()) {
    std::memcpy(full_.data_ptr(), input.data_ptr(), input.nbytes());
  } else {
    full_.variable_data().copy_(input);
  }
}

void FlatParam::bump_param_versions() {
  for (at::Tensor& p : params_) p.unsafeGetTensorImpl()->bump_version();
}

at::Tensor FlatParam::take_grads(c10::ScalarType dtype) {
  c10::NoGradGuard no_grad;
  // One parameter filling the whole buffer (no padding): its gradient is the flat gradient
  // already. Taking it instead of copying halves the unit's peak at its reduction (a tied
  // 50257 x 512 embedding: 98 MiB). Other references to it are harmless: a reduction reads
  // its input and never writes it (Communicator::reduce_scatter), and the autograd engine,
  // which still holds it while the post-hook that gets here runs, drops it unread.
  if (params_.size() == 1 && padded_ == numel_ && params_[0].grad().defined()) {
    const at::Tensor& g = params_[0].grad();
    if (g.layout() == at::kStrided && g.is_contiguous() && g.scalar_type() == dtype &&
        g.device() == full_.device()) {
      at::Tensor flat = g.view({-1});
      params_[0].mutable_grad().reset();
      return flat;
    }
  }
  at::Tensor flat = at::zeros({padded_}, full_.options().dtype(dtype));
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (p.grad().defined()) flat.narrow(0, offsets_[i], p.numel()).copy_(p.grad().reshape({-1}));
    p.mutable_grad().reset();  // the unsharded gradient is not kept
  }
  return flat;
}

void FlatParam::add_grads_to(at::Tensor& sum) {
  c10::NoGradGuard no_grad;
  if (!sum.defined()) sum = at::zeros({padded_}, full_.options().dtype(at::kFloat));
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (p.grad().defined()) sum.narrow(0, offsets_[i], p.numel()).add_(p.grad().reshape({-1}));
    p.mutable_grad().reset();
  }
}

}  // namespace dtrain::fsdp

// Deferred parameters and their rank-independent initial values (dtrain/deferred_init.h).
#include "dtrain/deferred_init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <set>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "compat/torch_compat.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

size_t needed_bytes(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
}

}  // namespace

uint64_t param_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 0x100000001b3ULL;
  }
  return splitmix64(splitmix64(seed) ^ h);
}

at::Tensor initial_value(const DeferredInit& init, const std::string& name, at::IntArrayRef shape) {
  if (!init.init) throw InvalidArgument("deferred init: DeferredInit::init is empty");
  c10::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(param_seed(init.seed, name));
  at::Tensor value = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  init.init(name, value, gen);
  if (value.sizes() != shape || value.scalar_type() != at::kFloat || !value.device().is_cpu()) {
    throw InvalidArgument(fmt::format(
        "deferred init of '{}': the init function must fill the fp32 CPU tensor it is given "
        "in place (shape {})",
        name, fmt::join(shape, "x")));
  }
  return value;
}

bool is_deferred(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 && compat::storage_is_released(t);
}

void defer_parameters(torch::nn::Module& module, c10::optional<c10::Device> device) {
  c10::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor p = item.value();
    if (device && p.device() != *device) {
      if (!p.is_leaf()) {
        throw InvalidArgument("defer_parameters: parameter '" + item.key() + "' is not a leaf");
      }
      // Never written: the allocation is given back below before any page is touched.
      p.set_data(at::empty(p.sizes(), p.options().device(*device)));
    }
    if (p.numel() == 0 || is_deferred(p)) continue;  // tied: freed under its first name
    compat::take_storage(p);                         // the memory goes back to the allocator here
  }
}

void init_parameter(const std::string& name, const at::Tensor& param, const DeferredInit& init) {
  c10::NoGradGuard no_grad;
  if (!param.is_contiguous()) {
    throw InvalidArgument(fmt::format("deferred init: parameter '{}' is not contiguous", name));
  }
  const at::Tensor value = initial_value(init, name, param.sizes());
  if (is_deferred(param)) {
    const size_t bytes = needed_bytes(param);
    compat::fill_storage(param, compat::storage_allocator(param).allocate(bytes), bytes);
  }
  at::Tensor target = param;
  target.copy_(value);
}

void init_parameters(torch::nn::Module& module, const DeferredInit& init) {
  std::set<const c10::TensorImpl*> done;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!done.insert(item.value().unsafeGetTensorImpl()).second) continue;
    init_parameter(item.key(), item.value(), init);
  }
}

}  // namespace dtrain

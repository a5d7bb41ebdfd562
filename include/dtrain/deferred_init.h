// Deferred initialisation: a model whose parameters hold no memory until a strategy
// materialises what its rank keeps, with initial values that do not depend on the rank.
//
// A model too large for one rank cannot be built whole on every rank first. Instead:
//
// clang-format off
//   auto model = std::make_shared<Net>(config);   // built as usual (allocates) ...
//   dtrain::defer_parameters(*model);             // ... then its parameters' memory freed
//   // (a large model defers each block right after building it: the peak is one block)
//   dtrain::DeferredInit init{seed, [](const std::string& /*name*/, at::Tensor& p,
//                                       at::Generator& gen) { p.normal_(0, 0.02, gen); }};
//   dtrain::FsdpOptions o;
//   o.deferred_init = init;                       // FSDP materialises only this rank's shard
//   dtrain::FullyShardedDataParallel fsdp(model, comm, o);
// clang-format on
//
// and, for single-device or DDP training with the same initial values,
//
// clang-format off
//   dtrain::init_parameters(*model, init);        // allocates and initialises every parameter
// clang-format on
//
// Every parameter is initialised on its own, drawing only from a CPU generator seeded with
// param_seed(seed, name), name being its qualified name in the model. Its values therefore
// depend on the seed and the name alone: not on the rank, the world size, the sharding
// strategy, the wrap policy, or the order parameters are initialised in. FSDP initialises
// one whole parameter at a time (the parameters that overlap this rank's shard), keeps its
// part of it and frees the rest, so no rank holds more than its shards plus one parameter.
//
// LibTorch's meta device is not used: C++ modules keep typed handles to their parameter
// tensors (Linear::weight), so a parameter must stay the same tensor object when it gets
// memory, and LibTorch cannot give a meta tensor CPU or CUDA storage in place. A deferred
// parameter is a tensor of the right shape, dtype and device whose storage holds no memory.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>
#include <string>

namespace torch::nn {
class Module;
}

namespace dtrain {

// Fills `param` (a contiguous fp32 CPU tensor of the parameter's shape, uninitialised) with
// the initial value of the parameter called `name`, drawing random numbers only from
// `generator` (e.g. param.normal_(0, 0.02, generator)).
using ParamInit =
    std::function<void(const std::string& name, at::Tensor& param, at::Generator& generator)>;

struct DeferredInit {
  uint64_t seed = 0;
  ParamInit init;
};

// The seed of the generator parameter `name` is initialised from: a mix (FNV-1a of the name,
// then SplitMix64 with `seed`) that differs between names and between seeds.
uint64_t param_seed(uint64_t seed, const std::string& name);

// The initial value of parameter `name` with `shape`, as init_parameters computes it: an
// fp32 CPU tensor. Throws InvalidArgument when init.init is empty.
at::Tensor initial_value(const DeferredInit& init, const std::string& name, at::IntArrayRef shape);

// Frees the memory of every parameter of `module` and its submodules, keeping each tensor
// object (shape, dtype, requires_grad; the module's handles stay valid), on `device` when
// given (moved there without copying any data: a CUDA model never holds its weights on the
// CPU first). Until it is materialised, by init_parameters or by FullyShardedDataParallel
// with FsdpOptions::deferred_init, nothing may read or write a deferred parameter (nor move
// the module: Module::to would copy it; with `device` it is already where it belongs).
void defer_parameters(torch::nn::Module& module, c10::optional<c10::Device> device = c10::nullopt);

// Whether `t` is deferred: it has elements but its storage holds no memory.
bool is_deferred(const at::Tensor& t);

// Gives one parameter its initial_value under `name`, first giving it memory when it is
// deferred. Throws InvalidArgument when it is not contiguous.
void init_parameter(const std::string& name, const at::Tensor& param, const DeferredInit& init);

// Gives every parameter of `module` (deferred or not) its initial_value: deferred ones get
// memory first. A parameter registered under several names (tied weights) is initialised
// once, under the first name named_parameters() lists. Throws InvalidArgument for a
// parameter that is not contiguous.
void init_parameters(torch::nn::Module& module, const DeferredInit& init);

}  // namespace dtrain

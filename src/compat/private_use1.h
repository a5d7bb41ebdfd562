// A test backend on PrivateUse1 (tests/support/fake_device) as LibTorch sees it. From 2.13,
// autograd and the optimizers ask at::getAccelerator() for "the" accelerator and its hooks;
// a PrivateUse1 backend is one only once its name and hooks are registered, else they throw
// "Cannot access accelerator device when none is available". Earlier releases ask nothing.
#pragma once

#include <torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#include <ATen/Context.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceType.h>

#include <string>

namespace dtrain::compat {
namespace detail {
struct PrivateUse1AcceleratorHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();  // the test backend draws on the CPU
  }
  at::Device getDeviceFromPtr(void*) const override {
    return at::Device(c10::DeviceType::PrivateUse1, 0);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
};
}  // namespace detail

// Registers `name` as the PrivateUse1 backend with hooks that make it an available
// accelerator whose generator is the CPU's. Once per process, before its first tensor.
inline void register_privateuse1_accelerator(const std::string& name) {
  static detail::PrivateUse1AcceleratorHooks hooks;
  c10::register_privateuse1_backend(name);
  at::RegisterPrivateUse1HooksInterface(&hooks);
}
}  // namespace dtrain::compat

#else

#include <string>

namespace dtrain::compat {
inline void register_privateuse1_accelerator(const std::string& /*name*/) {}
}  // namespace dtrain::compat

#endif

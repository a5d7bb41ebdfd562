#include "support/fake_device.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_copy_from_and_resize_native.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "compat/private_use1.h"

namespace dtrain::testing {
namespace {

constexpr c10::DeviceType kFake = c10::DeviceType::PrivateUse1;

void* to_fake(void* real) {
  return real == nullptr
             ? nullptr
             : reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(real) + kFakeAddressOffset);
}

// Host memory behind every fake storage. The DataPtr's context is the real allocation, its data
// the unmappable fake address: whoever frees the storage frees the real memory, whoever reads
// through data() faults.
void free_real(void* real) { c10::GetCPUAllocator()->raw_deleter()(real); }

// The device index a thread is on, as CUDA's current device: what a device guard sets, where
// tensors made without an index go, and what the autograd engine's device threads set.
thread_local c10::DeviceIndex current_index = 0;

// Host reads (HostReads): process-wide counts, and this thread's depth of uncounted scopes
// (UncountedHostReads, the fallback's own copies).
std::atomic<int64_t> local_scalar_dense_calls{0};
std::atomic<int64_t> device_to_host_copy_calls{0};
thread_local int uncounted_depth = 0;

void count_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (uncounted_depth == 0 && dst.device().is_cpu() && is_fake(src)) ++device_to_host_copy_calls;
}

c10::DeviceIndex checked_index(c10::Device d) {
  TORCH_CHECK(d.type() == kFake, "not the fake test device: ", d);
  if (!d.has_index()) return current_index;
  TORCH_CHECK(d.index() >= 0 && d.index() < kFakeDeviceCount,
              "the fake test device has indices 0 to ", kFakeDeviceCount - 1, "; got ", d);
  return d.index();
}

// One allocator per index, so a storage's allocator (which FSDP's refill uses) allocates on
// that storage's device; index -1 is the registered one, allocating on the current device.
struct FakeAllocator final : c10::Allocator {
  explicit FakeAllocator(c10::DeviceIndex index = -1) : index_(index) {}
  at::DataPtr make(size_t nbytes) const {
    const c10::Device device(kFake, index_ >= 0 ? index_ : current_index);
    if (nbytes == 0) return at::DataPtr(nullptr, device);
    at::DataPtr real = c10::GetCPUAllocator()->allocate(nbytes);
    // The CPU allocator's pointer is its own context and its deleter is raw_deleter(): take it.
    TORCH_INTERNAL_ASSERT(real.get() == real.get_context());
    void* p = real.release_context();
    return at::DataPtr(to_fake(p), p, &free_real, device);
  }
  // LibTorch 1.13 declares allocate() const, later versions non-const: defining both (without
  // `override`, which would name only one) overrides whichever this LibTorch has.
  at::DataPtr allocate(size_t nbytes) const { return make(nbytes); }
  at::DataPtr allocate(size_t nbytes) { return make(nbytes); }
  // Pure virtual in later LibTorch versions (storage copies); absent in 1.13.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count != 0) std::memcpy(host_address(dest), host_address(src), count);
  }

 private:
  c10::DeviceIndex index_;
};

FakeAllocator current_device_allocator;

c10::Allocator* allocator(c10::DeviceIndex index) {
  static FakeAllocator* const per_index = [] {
    auto* all = new FakeAllocator[kFakeDeviceCount];  // never freed: storages outlive main()
    for (c10::DeviceIndex i = 0; i < kFakeDeviceCount; ++i) all[i] = FakeAllocator(i);
    return all;
  }();
  TORCH_INTERNAL_ASSERT(index >= 0 && index < kFakeDeviceCount);
  return &per_index[index];
}

c10::Allocator* allocator_for(c10::optional<c10::Device> device) {
  return allocator(device.has_value() ? checked_index(*device) : current_index);
}

// kFakeDeviceCount devices, each with one default stream; work is synchronous, so events
// complete at once.
struct FakeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kFake; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    current_index = checked_index(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kFake, current_index); }
  void setDevice(c10::Device d) const override { current_index = checked_index(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index() && d.index() >= 0 && d.index() < kFakeDeviceCount) current_index = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    static char recorded;
    *event = &recorded;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  c10::DeviceIndex deviceCount() const noexcept override { return kFakeDeviceCount; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

constexpr c10::DispatchKeySet kFakeKeys{c10::DispatchKey::PrivateUse1};

at::Tensor empty_memory_format(at::IntArrayRef size, c10::optional<at::ScalarType> dtype,
                               c10::optional<at::Layout> layout, c10::optional<c10::Device> device,
                               c10::optional<bool>, c10::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided,
              "the fake test device has strided tensors only");
  return at::detail::empty_generic(size, allocator_for(device), kFakeKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride,
                         c10::optional<at::ScalarType> dtype, c10::optional<at::Layout> layout,
                         c10::optional<c10::Device> device, c10::optional<bool>) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided,
              "the fake test device has strided tensors only");
  return at::detail::empty_strided_generic(size, stride, allocator_for(device), kFakeKeys,
                                           c10::dtype_or_default(dtype));
}

// The CPU tensor a kernel works on: the tensor itself when on the CPU, its host view when fake.
at::Tensor on_host(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return t;
  TORCH_CHECK(is_fake(t), "the fake test device copies only to and from the CPU; got a tensor on ",
              t.device());
  return host_view(t);
}

at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  if (self.is_same(src)) return self;
  count_copy(self, src);
  on_host(self).copy_(on_host(src), non_blocking);
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  count_copy(dst, self);
  on_host(dst).copy_(on_host(self), non_blocking);
  return dst;
}

// Grows the storage of `self` (fake) to hold `nbytes`, keeping its contents: what
// resize_bytes_cpu does, with the copy done on host addresses.
void grow_storage(const at::Tensor& self, size_t nbytes) {
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  if (nbytes <= storage->nbytes()) return;
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  at::DataPtr grown = allocator(self.device().index())->allocate(nbytes);
  if (storage->nbytes() != 0) {
    std::memcpy(host_address(grown.get()), host_address(storage->data_ptr().get()),
                storage->nbytes());
  }
  storage->set_data_ptr_noswap(std::move(grown));
  storage->set_nbytes(nbytes);
}

const at::Tensor& resize_(const at::Tensor& self, at::IntArrayRef size,
                          c10::optional<at::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (self.sizes() != size) {
    impl->set_sizes_contiguous(size);
    if (impl->numel() != 0) {
      grow_storage(self, at::detail::computeStorageNbytesContiguous(size, impl->dtype().itemsize(),
                                                                    impl->storage_offset()));
    }
  }
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != at::MemoryFormat::Preserve, "Unsupported memory format ",
                *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) resize_(dst, self.sizes(), c10::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                               at::IntArrayRef size, at::IntArrayRef stride) {
  at::native::checkSetStorage(self, source, storage_offset, size, stride);
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  size_t nbytes = 0;
  if (stride.size() == size.size() && (stride.data() != nullptr || size.empty())) {
    impl->set_sizes_and_strides(size, stride);
    nbytes =
        at::detail::computeStorageNbytes(size, stride, impl->dtype().itemsize(), storage_offset);
  } else {
    TORCH_CHECK(stride.empty(), "set_: ", size.size(), " sizes but ", stride.size(), " strides");
    impl->set_sizes_contiguous(size);
    nbytes =
        at::detail::computeStorageNbytesContiguous(size, impl->dtype().itemsize(), storage_offset);
  }
  if (impl->numel() != 0) grow_storage(self, nbytes);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_offset(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage_offset(self, source.storage(), source.storage_offset(), source.sizes(),
                            source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, allocator(self.device().index()),
                     /*resizable=*/true);
  return set_storage_offset(self, std::move(empty), 0, {0}, {});
}

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& value) {
  host_view(self).fill_(value);
  return self;
}

at::Tensor& zero_(at::Tensor& self) {
  host_view(self).zero_();
  return self;
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  if (uncounted_depth == 0) ++local_scalar_dense_calls;
  return at::_local_scalar_dense(host_view(self));
}

// Module::to(device) swaps each parameter's tensor with set_data(), allowed only between
// compatible tensor types; LibTorch 1.13 counts CPU and CUDA as dense but not PrivateUse1.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  const auto dense = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && !t.is_quantized() && (t.device().is_cpu() || is_fake(t));
  };
  if (dense(self) && dense(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// The device of the first fake tensor in `v`, if any.
c10::optional<c10::Device> fake_device_of(const c10::IValue& v) {
  if (v.isTensor() && is_fake(v.toTensor())) return v.toTensor().device();
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) {
      if (is_fake(t)) return t.device();
    }
  }
  if (v.isOptionalTensorList()) {
    for (const auto& t : v.toOptionalTensorVector()) {
      if (t.has_value() && is_fake(*t)) return t->device();
    }
  }
  return c10::nullopt;
}

c10::IValue to_device(const c10::IValue& v, c10::Device device) {
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().is_cpu()) {
    return v.toTensor().to(device);
  }
  if (v.isTensorList()) {
    std::vector<at::Tensor> moved = v.toTensorVector();
    for (at::Tensor& t : moved) {
      if (t.defined() && t.device().is_cpu()) t = t.to(device);
    }
    return c10::IValue(c10::List<at::Tensor>(std::move(moved)));
  }
  return v;
}

// As a CUDA kernel would: all of an operator's tensors on one device, except CPU scalars.
void check_same_device(const c10::OperatorHandle& op, const at::Tensor& t, c10::Device device) {
  if (!t.defined() || t.device() == device || (t.device().is_cpu() && t.dim() == 0)) return;
  TORCH_CHECK(false,
              "Expected all tensors to be on the same device, but found at least two "
              "devices, ",
              device, " and ", t.device(), "! (", op.schema().name(), " on the fake test device)");
}

// An operator that writes a list of tensors and returns nothing: the in-place foreach
// operators (_foreach_mul_, ...). LibTorch 1.13's cpu_fallback does not copy a written list
// back (every such call would silently change nothing), so these run here instead.
bool writes_a_list_only(const c10::FunctionSchema& schema) {
  if (!schema.returns().empty()) return false;
  for (const c10::Argument& a : schema.arguments()) {
    const c10::AliasInfo* alias = a.alias_info();
    if (alias != nullptr && alias->isWrite() && a.type()->kind() == c10::TypeKind::ListType) {
      return true;
    }
  }
  return false;
}

// The operator's CPU kernel on host views of the fake arguments: it reads and writes the
// fake memory in place, as the device's own kernel would.
void run_on_host_views(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first) {
  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor() && is_fake(v.toTensor())) {
      v = c10::IValue(host_view(v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> views;
      for (const at::Tensor& t : v.toTensorVector()) views.push_back(is_fake(t) ? host_view(t) : t);
      v = c10::IValue(std::move(views));
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// Everything not above: LibTorch's CPU kernel on CPU copies of the arguments, results and
// mutated arguments copied back (through copy_ / _copy_from_and_resize above). Around
// at::native::cpu_fallback: tensors on other devices are refused as CUDA refuses them (a CPU
// tensor mixed with device tensors must fail here as it would on a GPU); and results go to the
// operator's fake device, which LibTorch 1.13's cpu_fallback takes from the first Tensor argument
// only (cat's inputs are a list; a CPU scalar may come first) and not from a Device argument.
// Indices (lists of optional tensors) may be on the CPU, as with CUDA.
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  UncountedHostReads own_copies;  // of the CPU kernel's arguments: no such copy on a GPU
  const size_t num_args = op.schema().arguments().size();
  const size_t first = stack->size() - num_args;
  c10::optional<c10::Device> device;
  for (size_t i = first; i < stack->size() && !device.has_value(); ++i) {
    device = fake_device_of((*stack)[i]);
  }
  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isDevice() && v.toDevice().type() == kFake) {
      if (!device.has_value()) device = v.toDevice();
      v = c10::IValue(c10::Device(c10::DeviceType::CPU));
    }
    // Lists of optional tensors (index's indices, never written) are not moved by 1.13's
    // cpu_fallback.
    if (v.isOptionalTensorList()) {
      c10::List<c10::optional<at::Tensor>> on_cpu;
      for (const auto& t : v.toOptionalTensorVector()) {
        on_cpu.push_back(t.has_value() && is_fake(*t) ? c10::optional<at::Tensor>(t->to(at::kCPU))
                                                      : t);
      }
      v = c10::IValue(std::move(on_cpu));
    }
  }
  if (device.has_value()) {
    for (size_t i = first; i < stack->size(); ++i) {
      const c10::IValue& v = (*stack)[i];
      if (v.isTensor()) check_same_device(op, v.toTensor(), *device);
      if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorVector()) check_same_device(op, t, *device);
      }
    }
  }
  if (writes_a_list_only(op.schema())) {
    run_on_host_views(op, stack, first);
    return;
  }
  at::native::cpu_fallback(op, stack);
  if (!device.has_value()) return;
  const size_t num_returns = op.schema().returns().size();
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    (*stack)[i] = to_device((*stack)[i], *device);
  }
}

}  // namespace

c10::Device fake_device(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kFakeDeviceCount, "the fake test device has indices 0 to ",
              kFakeDeviceCount - 1, "; got ", int(index));
  return c10::Device(kFake, index);
}

bool is_fake(const at::Tensor& t) { return t.defined() && t.device().type() == kFake; }

void* host_address(const void* fake_pointer) {
  return fake_pointer == nullptr
             ? nullptr
             : reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(fake_pointer) -
                                       kFakeAddressOffset);
}

at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined()) return t;
  TORCH_CHECK(is_fake(t), "host_view: the tensor is on ", t.device(), ", not the fake device");
  c10::Storage keep = t.storage();
  void* base = host_address(keep.data_ptr().get());
  const size_t nbytes = keep.nbytes();
  at::DataPtr data = c10::InefficientStdFunctionContext::makeDataPtr(
      base, [keep = std::move(keep)](void*) {}, c10::Device(c10::DeviceType::CPU));
  c10::Storage host(c10::Storage::use_byte_size_t(), nbytes, std::move(data),
                    /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(host), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                   c10::make_optional(t.storage_offset()));
  return out;
}

HostReads host_reads() {
  return {local_scalar_dense_calls.load(), device_to_host_copy_calls.load()};
}

UncountedHostReads::UncountedHostReads() { ++uncounted_depth; }
UncountedHostReads::~UncountedHostReads() { --uncounted_depth; }

void ensure_fake_device_registered() {
  // Registration is static (below); this checks that it happened in this process.
  TORCH_CHECK(c10::GetAllocator(kFake) == &current_device_allocator,
              "another allocator is registered for PrivateUse1: two fake backends in one process");
}

}  // namespace dtrain::testing

// Process-wide registrations, run once when the binary loads (see the header).
namespace {
using namespace dtrain::testing;

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &current_device_allocator);
C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuardImpl);
// LibTorch 2.13+: PrivateUse1 must be a registered accelerator (src/compat/private_use1.h).
const bool kFakeAccelerator = [] {
  dtrain::compat::register_privateuse1_accelerator("dtrain_fake");
  return true;
}();

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  // Views alias the fake storage: LibTorch's device-independent kernels.
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("alias", TORCH_FN(at::native::alias));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  // copy_ directly: LibTorch 1.13's copy_ has no route to _copy_from for PrivateUse1.
  m.impl("copy_", TORCH_FN(copy_));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("fill_.Scalar", TORCH_FN(fill_scalar));
  m.impl("zero_", TORCH_FN(zero_));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
}

// A kernel of our own on PrivateUse1 removes LibTorch's composite one from AutogradPrivateUse1
// too; the query has nothing to differentiate, so the same kernel serves both keys.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// An operator with both a CPU kernel and a composite one (CompositeExplicitAutograd, e.g.
// native_layer_norm's math_native_layer_norm) would run the composite on fake tensors, since a
// composite kernel takes precedence over a backend fallback: a different computation from the
// CPU's, equal only to rounding. Sending such operators to the fallback by name makes the fake
// device run the CPU's kernel, so results are bitwise the CPU's. View operators stay composite
// (they alias fake storage); operators with a kernel of ours are left alone. Runs after the
// registrations above (same translation unit, later definition) and after LibTorch's own
// (loaded before this binary's initialisers).
struct PreferCpuKernels {
  PreferCpuKernels()
      : lib(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__) {
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      const auto op = dispatcher.findOp(name);
      if (!op.has_value() || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
        continue;
      }
      if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
          !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
        continue;
      }
      const auto& returns = op->schema().returns();
      const bool view = std::any_of(returns.begin(), returns.end(), [](const c10::Argument& r) {
        return r.alias_info() != nullptr && !r.alias_info()->isWrite();
      });
      if (view) continue;
      std::string qualified = name.name.substr(6);
      if (!name.overload_name.empty()) qualified += "." + name.overload_name;
      lib.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
      ++count;
    }
  }
  torch::Library lib;
  int count = 0;
};
PreferCpuKernels prefer_cpu_kernels;

}  // namespace

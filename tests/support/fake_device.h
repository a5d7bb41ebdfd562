#pragma once

// A fake accelerator for tests: LibTorch's PrivateUse1 device ("privateuseone:0"), whose memory
// host code cannot read.
//
// How to use. Link tests/support/fake_device.cpp into the test binary (registration happens when
// the binary loads). Put a model on the device with `model->to(dtrain::testing::fake_device())`,
// tensors with `t.to(fake_device())` or `at::zeros(sizes, at::device(fake_device()))`, and give
// the strategy under test a communicator whose device() is fake_device(). Every ATen operation
// works on fake tensors (forward and backward, optimizers, bf16), computed on the CPU behind the
// scenes, with results equal to the same computation on CPU tensors. What does not work, on
// purpose, is host code touching a fake tensor's memory: `data_ptr()` (and the storage's data
// pointer) is the real address plus kFakeAddressOffset, an address no process can map, so
// `std::memcpy(dst, t.data_ptr(), n)` or a `data_ptr<float>()` loop dies with SIGSEGV, as it
// would on a CUDA tensor with NCCL, instead of silently working as it does for CPU tensors. A
// communicator for contract tests checks `t.device() == fake_device()` for every tensor it is
// handed and moves data only with ATen copies (`t.to(at::kCPU)`, `dst.copy_(src)`); if it must see
// the bytes in place (e.g. to reduce without a copy), host_view() gives a CPU tensor aliasing them.
// Streams and events are no-ops (there is one default stream; events complete at once). As on
// CUDA, an operator refuses tensors on different devices (a CPU tensor next to fake ones, or two
// fake indices), except CPU 0-dim scalars and CPU indices: code that combines a host tensor with
// device tensors fails here as it would on a GPU.
//
// Ranks as threads: give rank r the device fake_device(r), as each rank of a real job has its own
// GPU. LibTorch's autograd engine runs the backward work of each device on one thread per device
// index; ranks sharing one index share that thread, and a rank whose backward hook waits for a
// collective (FSDP's unshard, DDP's final wait) then blocks the other ranks' backward behind it:
// a deadlock the test would report as a timeout, not a bug of the strategy. A tensor made
// without an index (at::device(at::kPrivateUse1)) goes to the thread's current fake device, which
// c10::DeviceGuard sets, as with CUDA.
//
// Registration is global in LibTorch by nature (kernels on the PrivateUse1 dispatch key, the
// device's allocator and device guard are process-wide tables): it runs once, from static
// initialisers in fake_device.cpp, when the test binary loads. Calling fake_device() or
// ensure_fake_device_registered() any number of times is harmless and registers nothing more. A
// process can hold only one PrivateUse1 backend, so this file must not be linked into a binary
// that registers another.
//
// Fidelity: every kernel is LibTorch's CPU kernel, run on CPU copies of the arguments
// (at::native::cpu_fallback; mutated arguments are copied back) or on host_view()s, so results
// are bitwise equal to the CPU's for the same operations, provided the CPU computation is itself
// deterministic (OMP_NUM_THREADS=1, as ctest sets, for reductions). Operators that have both a
// CPU kernel and a composite one (native_layer_norm, ...) are sent to the CPU kernel too, not
// decomposed. View operations (view, as_strided, _reshape_alias, unfold, alias, set_, and the
// composite ones built on them: narrow, select, transpose, expand, ...) alias fake storage
// natively, exactly as on a real device. The random number generator is the CPU's.
//
// What a fake tensor is not: it is not on a CUDA device (is_cuda() is false), so code that
// branches on is_cuda() takes its non-CUDA path; and it has no streams to order. A test with it
// proves "only tensors on the communicator's device, no host access to device memory", not
// CUDA stream semantics.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace dtrain::testing {

// Added to every real address the fake allocator hands out. Above any user-space mapping on
// x86-64 (47-bit, or 56-bit with 5-level paging used only on request) and on AArch64 (48-bit,
// not in the top byte that top-byte-ignore would mask).
inline constexpr std::uintptr_t kFakeAddressOffset = std::uintptr_t{1} << 55;

// Fake devices privateuseone:0 to :kFakeDeviceCount-1, like the GPUs of one machine.
inline constexpr c10::DeviceIndex kFakeDeviceCount = 8;

// The fake device `index` (privateuseone:<index>); index outside [0, kFakeDeviceCount) throws.
c10::Device fake_device(c10::DeviceIndex index = 0);

// Whether `t` lives on the fake device.
bool is_fake(const at::Tensor& t);

// A CPU tensor aliasing the memory of the fake tensor `t` (same sizes, strides, offset, dtype;
// writes go through). Keeps t's storage alive. For kernels and communicators of tests only: it
// is exactly the host access the fake device exists to catch anywhere else.
at::Tensor host_view(const at::Tensor& t);

// The host address behind a fake data pointer (nullptr stays nullptr).
void* host_address(const void* fake_pointer);

// Host reads of fake memory: what would block the host until a GPU's stream has drained.
// Counted process-wide (every thread, every fake index) since the binary loaded; a test
// takes the difference of two readings. The fake device's own copies (running an operator's
// CPU kernel on CPU copies of its arguments) are not counted: on a GPU they do not happen.
struct HostReads {
  int64_t local_scalar_dense = 0;     // .item(), Scalar conversions, `if (tensor)`...
  int64_t device_to_host_copies = 0;  // copies from a fake tensor into a CPU tensor
  int64_t total() const { return local_scalar_dense + device_to_host_copies; }
  HostReads operator-(const HostReads& o) const {
    return {local_scalar_dense - o.local_scalar_dense,
            device_to_host_copies - o.device_to_host_copies};
  }
};
HostReads host_reads();

// While one is alive, host reads on this thread are not counted: for a test communicator's
// own staging through host memory, which NCCL does not do.
class UncountedHostReads {
 public:
  UncountedHostReads();
  ~UncountedHostReads();
  UncountedHostReads(const UncountedHostReads&) = delete;
  UncountedHostReads& operator=(const UncountedHostReads&) = delete;
};

// Registers the backend if it is not yet (it always is once fake_device.cpp is linked in): a
// no-op kept so a test can state its dependency explicitly.
void ensure_fake_device_registered();

}  // namespace dtrain::testing

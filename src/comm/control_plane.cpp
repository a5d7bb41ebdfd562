#include "comm/control_plane.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>

namespace dtrain {
namespace {

template <typename T>
constexpr c10::ScalarType dtype_of();
template <>
constexpr c10::ScalarType dtype_of<int64_t>() {
  return at::kLong;
}
template <>
constexpr c10::ScalarType dtype_of<double>() {
  return at::kDouble;
}
template <>
constexpr c10::ScalarType dtype_of<uint8_t>() {
  return at::kByte;
}

// A host tensor holding a copy of `values` (its own memory: the vector may go away).
template <typename T>
at::Tensor host_tensor(const std::vector<T>& values) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions(dtype_of<T>()));
  if (!values.empty()) std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(T));
  return t;
}

template <typename T>
std::vector<T> host_values(const at::Tensor& t) {
  const at::Tensor h = t.to(at::kCPU).contiguous();  // an ATen copy from any device
  const T* p = h.data_ptr<T>();
  return std::vector<T>(p, p + h.numel());
}

}  // namespace

at::TensorOptions ControlPlane::options(c10::ScalarType dtype) const {
  return at::TensorOptions().dtype(dtype).device(device());
}

at::Tensor ControlPlane::to_device(const at::Tensor& t) const {
  // A copy even when `t` is on device() already: collectives write their tensor in place.
  return t.to(device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
}

at::Tensor ControlPlane::all_reduce(const at::Tensor& t, ReduceOp op) {
  c10::NoGradGuard no_grad;
  at::Tensor d = to_device(t.detach());
  if (world_size() > 1) comm_.all_reduce(d, op)->wait();
  return d;
}

at::Tensor ControlPlane::all_gather(const at::Tensor& t) {
  c10::NoGradGuard no_grad;
  at::Tensor mine = to_device(t.detach().reshape({-1}));
  if (world_size() == 1) return mine;
  at::Tensor all = at::empty({world_size() * mine.numel()}, mine.options());
  comm_.all_gather(all, mine)->wait();
  return all;
}

template <typename T>
std::vector<T> ControlPlane::all_reduce(const std::vector<T>& values, ReduceOp op) {
  if (world_size() == 1) return values;
  return host_values<T>(all_reduce(host_tensor(values), op));
}

template <typename T>
std::vector<T> ControlPlane::all_gather(const std::vector<T>& values) {
  if (world_size() == 1) return values;
  return host_values<T>(all_gather(host_tensor(values)));
}

template <typename T>
std::vector<T> ControlPlane::broadcast(const std::vector<T>& values, int root) {
  if (world_size() == 1) return values;
  at::Tensor d = to_device(host_tensor(values));
  comm_.broadcast(d, root)->wait();
  return host_values<T>(d);
}

std::vector<std::string> ControlPlane::all_gather_bytes(const std::string& mine) {
  const int world = world_size();
  if (world == 1) return {mine};
  const std::vector<int64_t> lens =
      all_gather(std::vector<int64_t>{static_cast<int64_t>(mine.size())});
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  std::vector<uint8_t> padded(static_cast<size_t>(max_len), 0);
  std::copy(mine.begin(), mine.end(), padded.begin());
  const std::vector<uint8_t> all = all_gather(padded);
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) {
    const auto* p = reinterpret_cast<const char*>(all.data()) + r * max_len;
    out.emplace_back(p, static_cast<size_t>(lens[static_cast<size_t>(r)]));
  }
  return out;
}

template std::vector<int64_t> ControlPlane::all_reduce(const std::vector<int64_t>&, ReduceOp);
template std::vector<double> ControlPlane::all_reduce(const std::vector<double>&, ReduceOp);
template std::vector<uint8_t> ControlPlane::all_reduce(const std::vector<uint8_t>&, ReduceOp);
template std::vector<int64_t> ControlPlane::all_gather(const std::vector<int64_t>&);
template std::vector<double> ControlPlane::all_gather(const std::vector<double>&);
template std::vector<uint8_t> ControlPlane::all_gather(const std::vector<uint8_t>&);
template std::vector<int64_t> ControlPlane::broadcast(const std::vector<int64_t>&, int);
template std::vector<double> ControlPlane::broadcast(const std::vector<double>&, int);
template std::vector<uint8_t> ControlPlane::broadcast(const std::vector<uint8_t>&, int);

}  // namespace dtrain

// The control plane: every exchange between ranks that is not a gradient or a parameter —
// agreements, digests, flags, norms, metrics, checkpoint metadata — goes through here.
//
// Its tensors live on the communicator's device (Communicator::device()): CPU for Gloo, the
// rank's GPU for NCCL, the configured device for staged Gloo. So one communicator carries
// control and data in one order, whatever the backend accepts (docs/architecture.md,
// "Control plane"). Values go in and come out as host values; the copies to and from the
// device are ATen copies (never a host memcpy on device memory). Every call is a collective
// of the communicator: all ranks call it, in the same order, with the same sizes unless said
// otherwise. With one rank nothing is exchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/communicator.h"

namespace dtrain {

class ControlPlane {
 public:
  explicit ControlPlane(Communicator& comm) : comm_(comm) {}

  int rank() const { return comm_.rank(); }
  int world_size() const { return comm_.world_size(); }
  // Where control tensors live: comm.device().
  c10::Device device() const { return comm_.device(); }
  // Tensor options of dtype `dtype` on device().
  at::TensorOptions options(c10::ScalarType dtype) const;

  // Element-wise reduction over ranks of `values` (equal lengths on every rank). T is int64_t,
  // double or uint8_t (NCCL has no bool: flags are uint8_t).
  template <typename T>
  std::vector<T> all_reduce(const std::vector<T>& values, ReduceOp op);
  template <typename T>
  T all_reduce_value(T value, ReduceOp op) {
    return all_reduce(std::vector<T>{value}, op).front();
  }

  // Every rank's `values` (equal lengths), concatenated in rank order.
  template <typename T>
  std::vector<T> all_gather(const std::vector<T>& values);

  // `root`'s `values` (equal lengths on every rank) on every rank.
  template <typename T>
  std::vector<T> broadcast(const std::vector<T>& values, int root);

  // Every rank's bytes, of any length (two all-gathers: lengths, then the padded bytes).
  std::vector<std::string> all_gather_bytes(const std::string& mine);

  // Tensor forms, for values already in a tensor (on any device): the result is on device().
  // all_reduce does not modify `t`; all_gather returns world_size * t.numel() elements.
  at::Tensor all_reduce(const at::Tensor& t, ReduceOp op);
  at::Tensor all_gather(const at::Tensor& t);

 private:
  at::Tensor to_device(const at::Tensor& host) const;

  Communicator& comm_;
};

}  // namespace dtrain

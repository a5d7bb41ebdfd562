// What a backend implements: moving data for calls the front end (front_end.h) has already
// validated, numbered and bounded. Argument checks common to every backend, timeouts,
// sequence numbers and the sticky failure live in the front end, not here.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>

#include "comm/call_header.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain::detail {

// How long Work::wait() blocks by default: the call is bounded by `timeout` once it starts;
// the margin covers the time it spends queued behind earlier calls.
inline std::chrono::milliseconds host_wait_bound(std::chrono::milliseconds timeout) {
  return 2 * timeout + std::chrono::seconds(1);
}

// A collective, validated. `tensor` is the tensor of all_reduce and broadcast and the output
// of all_gather and reduce_scatter; `input` is set for the last two only.
struct Collective {
  CollectiveOp op = CollectiveOp::kBarrier;
  at::Tensor tensor;
  at::Tensor input;
  ReduceOp reduce = ReduceOp::kSum;
  int root = -1;
  ErrorContext context;  // rank, op and sequence number
  std::chrono::milliseconds timeout{0};
  CallHeader header;  // what ranks compare before moving data
};

struct PointToPoint {
  bool is_send = true;
  at::Tensor tensor;
  int peer = -1;
  uint32_t tag = 0;
  ErrorContext context;  // sequence: the point-to-point count
  std::chrono::milliseconds timeout{0};
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual Backend backend() const = 0;
  // What Communicator::transport_name() reports.
  virtual const char* name() const { return to_string(backend()); }
  // What Communicator::device() reports: the device of the tensors check_tensor accepts.
  virtual c10::Device device() const = 0;
  // Throws InvalidArgument(ctx, "<what>: <why>") unless this backend can move `t` (its
  // device, its dtype). The front end already checked it is defined, dense and contiguous.
  virtual void check_tensor(const at::Tensor& t, const ErrorContext& ctx,
                            const char* what) const = 0;
  // Backend limits of a whole call (reductions per dtype, in-place layouts); throws
  // InvalidArgument.
  virtual void check_call(const Collective& /*call*/) const {}
  // Backend limits of a point-to-point call (NCCL: tags); throws InvalidArgument.
  virtual void check_call(const PointToPoint& /*call*/) const {}
  // Start a call and return its Work without waiting for peers; failures land in the Work.
  // The front end calls these under one lock, in sequence-number order.
  virtual WorkPtr start(Collective call) = 0;
  virtual WorkPtr start(PointToPoint call) = 0;
};

}  // namespace dtrain::detail

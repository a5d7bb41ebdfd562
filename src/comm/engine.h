// A collective engine: what moves the data of calls the front end (front_end.h) has already
// validated, numbered and bounded. Each concrete engine is one data path, the "transport" of
// Communicator::transport_name() (Gloo's TCP pairs, shared memory, hierarchical, NCCL, and
// the staging wrapper for device tensors over a CPU one); backend_factory.h assembles them.
// Division of work: argument checks common to every backend, per-call timeouts, sequence
// numbers and the consistency header are the front end's; the engine checks what only it
// knows (devices, dtypes, reductions) and runs calls. The sticky failure (failure.h) is
// shared: the front end refuses calls once it is set, the engine records into it what fails
// while a call runs.
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

class CollectiveEngine {
 public:
  virtual ~CollectiveEngine() = default;

  // What Communicator::transport_name() reports: "gloo", "shared_memory", "hierarchical",
  // "nccl". (Communicator::backend() is the front end's: the backend the options asked for.)
  virtual const char* name() const = 0;
  // What Communicator::device() reports: the device of the tensors check_tensor accepts.
  virtual c10::Device device() const = 0;
  // Throws InvalidArgument(ctx, "<what>: <why>") unless this engine can move `t` (its
  // device, its dtype). The front end checked before that it is defined, dense (strided) and
  // contiguous.
  virtual void check_tensor(const at::Tensor& t, const ErrorContext& ctx,
                            const char* what) const = 0;
  // Engine limits of a whole call (reductions per dtype, in-place layouts); throws
  // InvalidArgument. Called before the call is numbered, so a refused call uses no number.
  virtual void check_call(const Collective& /*call*/) const {}
  // Engine limits of a point-to-point call (NCCL: tags); throws InvalidArgument.
  virtual void check_call(const PointToPoint& /*call*/) const {}
  // Start a call and return its Work without waiting for peers; failures land in the Work
  // (and in the shared sticky failure). The front end calls these under one lock, in
  // sequence-number order; a call issued once a failure is recorded never gets here.
  virtual WorkPtr start(Collective call) = 0;
  virtual WorkPtr start(PointToPoint call) = 0;
};

}  // namespace dtrain::detail

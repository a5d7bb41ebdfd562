// Gloo for tensors that are not on the CPU: every call's tensors are staged through host
// memory, so ranks can run a host transport (Gloo's TCP pairs, shared memory) on tensors
// of any device, several ranks on one GPU included (what NCCL refuses). Configured by
// CommunicatorOptions::device.
#pragma once

#include <c10/core/Device.h>

#include <memory>

#include "comm/engine.h"
#include "comm/failure.h"

namespace dtrain::detail {

// Wraps `host` (a CPU transport) into one that accepts tensors of `device` only. Each call
// copies its inputs to host memory on the caller's thread (pinned memory on CUDA; the copy is
// on the caller's current stream and synchronized before the host transport reads it), runs
// on the host transport, and copies its outputs back when its Work is waited for (on CUDA on
// the waiting thread's current stream). The Work owns the host buffers until then. A copy
// that fails fails its call and is recorded in `failure` (the communicator's). Throws
// InvalidArgument (context `ctx`) if LibTorch cannot allocate on `device`.
std::unique_ptr<CollectiveEngine> make_staging_transport(std::unique_ptr<CollectiveEngine> host,
                                                         c10::Device device, int rank,
                                                         std::shared_ptr<StickyFailure> failure,
                                                         const ErrorContext& ctx);

}  // namespace dtrain::detail

// Work of the NCCL backend: one call queued on the communicator's CUDA stream.
//
// Two events bracket the NCCL launch on that stream: `start` (the call may begin: the
// caller's earlier kernels and the communicator's earlier calls are done) and `done`.
//
//  * synchronize() and wait() make the caller's current stream wait on `done` and return
//    without blocking the host, as the Work contract asks of CUDA backends. They rethrow a
//    failure already known; a failure found later surfaces from the next call.
//  * wait(timeout) with an explicit timeout, and every wait() of a barrier, additionally
//    block the host until the call finished or failed (polling `done`), and throw
//    TimeoutError if it is still running after the timeout. As with Gloo, that does not
//    break the communicator: the call's own timeout, enforced by the watchdog, does.
//  * Failures are found by the communicator (NCCL's async errors, the per-call timeout, an
//    abort) and pushed in with fail(). Once failed, a work counts as completed.
//  * The tensors stay referenced until the watchdog saw `done`, so the CUDA caching
//    allocator cannot hand their memory to a new tensor while NCCL still uses it.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "comm/nccl/nccl_util.h"
#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain::nccl_backend {

class NcclWork final : public Work {
 public:
  // host_timeout bounds wait() when it blocks the host and was given no timeout.
  NcclWork(uint64_t seq, std::string op, ErrorContext context, int device, bool blocks_host,
           std::chrono::milliseconds host_timeout, std::vector<at::Tensor> tensors);

  bool is_completed() const override;
  void wait(std::chrono::milliseconds timeout = kDefaultTimeout) override;
  void synchronize() override;
  std::exception_ptr exception() const override;
  uint64_t sequence_number() const override { return seq_; }
  const std::string& op_name() const override { return op_; }

  // --- For NcclComm, which issues the call and watches it. ---

  const ErrorContext& context() const { return context_; }
  // Record the events on the communicator's stream, on the communicator's device.
  void record_start(cudaStream_t stream);
  void record_done(cudaStream_t stream);
  // Whether the GPU reached each event; false until it is recorded.
  bool started() const;
  bool finished() const;
  // Marks the call failed; the first failure wins.
  void fail(std::exception_ptr error);
  void release_tensors();

 private:
  bool reached(const Event& event) const;

  const uint64_t seq_;
  const std::string op_;
  const ErrorContext context_;
  const int device_;
  const bool blocks_host_;
  const std::chrono::milliseconds host_timeout_;
  Event start_;
  Event done_;

  mutable std::mutex mu_;
  mutable std::exception_ptr error_;  // is_completed() records CUDA failures it sees
  std::vector<at::Tensor> tensors_;
};

}  // namespace dtrain::nccl_backend

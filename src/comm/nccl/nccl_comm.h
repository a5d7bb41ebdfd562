// The NCCL side of one rank's communicator: the ncclComm_t, the CUDA stream every call runs
// on, the issue path, and the watchdog that fails and aborts calls that error or hang.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): NCCL calls return at once,
// possibly with ncclInProgress, and settle() polls them against a deadline. That is what
// bounds the initialisation, a launch that has to wait for connections, and the teardown.
//
// Once launched, a call runs on the GPU with no host thread attached. The watchdog thread
// follows the in-flight calls in issue order (they run in that order on the one stream):
// it releases a call's tensors once its `done` event was reached, polls
// ncclCommGetAsyncError, and fails the communicator when NCCL reports an error or when the
// oldest call has been running on the GPU for longer than its timeout. The clock of a call
// starts when its `start` event is reached, so time spent queued behind the caller's own
// kernels does not count. Failing means: mark every unfinished call failed, then
// ncclCommAbort (which makes NCCL's kernels return, so nothing waiting on them hangs). The
// first error sticks (in the StickyFailure shared with the front end): every later call
// fails at once and names it.
//
// Locks: launch_mu_ serialises every use of the ncclComm_t (a handle is not thread-safe, and
// a non-blocking one must not be used again before its last call settled). queue_mu_ guards
// the in-flight queue; it is taken inside launch_mu_, never around it.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "comm/failure.h"
#include "comm/nccl/nccl_util.h"
#include "comm/nccl/nccl_work.h"
#include "dtrain/work.h"

namespace dtrain::nccl_backend {

class NcclComm {
 public:
  // Issues one NCCL call (or a group) on the given communicator and stream.
  using Call = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;

  // Joins the `world_size` ranks that use `id`, on `device`. Throws TimeoutError if not all
  // of them joined by `join_deadline`, CommError if CUDA or NCCL fail. Failures are recorded
  // in `failure`.
  NcclComm(const ncclUniqueId& id, int rank, int world_size, int device,
           Clock::time_point join_deadline, std::chrono::milliseconds teardown_timeout,
           std::shared_ptr<detail::StickyFailure> failure);
  // Lets queued calls finish (bounded by teardown_timeout), then destroys the NCCL
  // communicator; aborts it instead if it is broken or the calls do not finish.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Runs `call` on the communicator's stream after the work the caller's current stream
  // holds so far, and returns its Work. `ctx` names the call, with its sequence number.
  // Failures (CUDA or NCCL errors, NCCL not accepting the call within `timeout`, a
  // communicator broken earlier) land in the Work and break the communicator; nothing is
  // thrown here. blocks_host: see NcclWork.
  WorkPtr launch(const ErrorContext& ctx, std::vector<at::Tensor> tensors,
                 std::chrono::milliseconds timeout, bool blocks_host, const Call& call);

  // One float of device memory for barriers.
  void* barrier_buffer() const { return barrier_buffer_.get(); }

 private:
  struct InFlight {
    std::shared_ptr<NcclWork> work;
    std::chrono::milliseconds timeout;
    std::optional<Clock::time_point> started;  // when the watchdog saw `start` reached
  };

  ErrorContext context(const char* op, int64_t seq) const;
  // Fails every unfinished call (origin with `error` itself, the others with a reference to
  // it), records `error` in the sticky failure, and aborts the NCCL communicator. launch_mu_
  // must be held.
  void break_locked(const std::exception_ptr& error, NcclWork* origin);
  // Waits until the stream ran everything queued on it; false on an NCCL error or deadline.
  bool drain_locked(Clock::time_point deadline);
  void watchdog_loop();
  // One watchdog round: retires finished calls, checks the oldest one and NCCL's state.
  void watch_once();

  const int rank_;
  const int world_size_;
  const int device_;
  const std::chrono::milliseconds teardown_timeout_;
  Stream stream_;
  Event caller_ready_;  // reused by every launch, under launch_mu_
  DeviceMemory barrier_buffer_;
  std::shared_ptr<detail::StickyFailure> failure_;

  std::mutex launch_mu_;
  ncclComm_t comm_ = nullptr;  // null once destroyed or aborted

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<InFlight> in_flight_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace dtrain::nccl_backend

#include "comm/nccl/nccl_comm.h"

#include <fmt/format.h>

#include "comm/engine.h"
#include "comm/nccl/current_stream.h"

namespace dtrain::nccl_backend {
namespace {

// How often the watchdog looks at in-flight calls: the delay before a finished call's
// tensors are released and before an NCCL error or a timeout is acted on.
constexpr std::chrono::milliseconds kWatchdogPeriod{10};

}  // namespace

NcclComm::NcclComm(const ncclUniqueId& id, int rank, int world_size, int device,
                   Clock::time_point join_deadline, std::chrono::milliseconds teardown_timeout,
                   std::shared_ptr<detail::StickyFailure> failure)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      teardown_timeout_(teardown_timeout),
      failure_(std::move(failure)) {
  const ErrorContext ctx = context("connect", -1);
  use_device(device_, ctx);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), ctx, "cudaStreamCreate");
  stream_.reset(stream);
  caller_ready_ = make_event(ctx);
  void* buffer = nullptr;
  check_cuda(cudaMalloc(&buffer, sizeof(float)), ctx, "cudaMalloc");
  barrier_buffer_.reset(buffer);

  comm_ = init_nonblocking_comm(world_size, id, rank, join_deadline, ctx, "NCCL communicator");
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

NcclComm::~NcclComm() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();

  std::lock_guard<std::mutex> launch_lock(launch_mu_);
  const ErrorContext ctx = context("destroy", -1);
  try {
    use_device(device_, ctx);
  } catch (const Error&) {
    // Best effort: teardown goes on with whatever device is current.
  }
  if (comm_ != nullptr) {
    const auto deadline = Clock::now() + teardown_timeout_;
    // Finalize, not a bare destroy: it is non-blocking, so a peer that died cannot hang us.
    bool clean = drain_locked(deadline);
    if (clean) clean = settle(comm_, ncclCommFinalize(comm_), deadline) == ncclSuccess;
    if (clean) {
      (void)ncclCommDestroy(comm_);
      comm_ = nullptr;
    } else {
      break_locked(std::make_exception_ptr(
                       CommError(ctx, fmt::format("the communicator was destroyed while calls were "
                                                  "running and they did not finish within {} ms",
                                                  teardown_timeout_.count()))),
                   nullptr);
    }
  }
  // After an abort NCCL's kernels return promptly: release their tensors only then.
  drain_locked(Clock::now() + teardown_timeout_);
  for (InFlight& f : in_flight_) {
    if (!f.work->finished()) {
      f.work->fail(std::make_exception_ptr(
          CommError(f.work->context(), "the communicator was destroyed before the call ran")));
    }
    f.work->release_tensors();
  }
}

ErrorContext NcclComm::context(const char* op, int64_t seq) const {
  return ErrorContext{rank_, world_size_, op, seq};
}

WorkPtr NcclComm::launch(const ErrorContext& ctx, std::vector<at::Tensor> tensors,
                         std::chrono::milliseconds timeout, bool blocks_host, const Call& call) {
  std::lock_guard<std::mutex> launch_lock(launch_mu_);
  // Same host bound as Gloo's works.
  auto work =
      std::make_shared<NcclWork>(static_cast<uint64_t>(ctx.sequence), ctx.op, ctx, device_,
                                 blocks_host, detail::host_wait_bound(timeout), std::move(tensors));
  if (auto earlier = failure_->check(ctx)) {
    work->fail(earlier);
    return work;
  }
  try {
    use_device(device_, ctx);
    // The stream-to-stream edge that orders the call after the caller's kernels.
    check_cuda(cudaEventRecord(caller_ready_.get(), current_stream(device_)), ctx,
               "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_.get(), caller_ready_.get(), 0), ctx,
               "cudaStreamWaitEvent");
    work->record_start(stream_.get());
    const ncclResult_t status = settle(comm_, call(comm_, stream_.get()), Clock::now() + timeout);
    if (status == ncclInProgress) {
      throw TimeoutError(ctx,
                         fmt::format("NCCL did not accept the call within {} ms", timeout.count()));
    }
    check_nccl(status, ctx, "NCCL call", comm_);
    // Only now: nothing may be queued on NCCL's stream while a call is in progress.
    work->record_done(stream_.get());
  } catch (const Error&) {
    // This rank's sequence of calls now differs from its peers': nothing later can match.
    break_locked(std::current_exception(), work.get());
    return work;
  }
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    in_flight_.push_back(InFlight{work, timeout, std::nullopt});
  }
  queue_cv_.notify_one();
  return work;
}

void NcclComm::break_locked(const std::exception_ptr& error, NcclWork* origin) {
  std::vector<std::shared_ptr<NcclWork>> unfinished;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    failure_->record(error);
    for (InFlight& f : in_flight_) {
      if (!f.work->finished()) unfinished.push_back(f.work);
    }
  }
  // Before the abort: an aborted call's `done` event is reached too, with garbage results,
  // and must not look like a success. The works stay queued so that the watchdog releases
  // their tensors only once NCCL's kernels have returned.
  for (const auto& work : unfinished) {
    if (work.get() == origin) continue;
    work->fail(detail::after_failure(work->context(), error,
                                     "communicator aborted after an earlier failure"));
  }
  if (origin != nullptr) origin->fail(error);
  if (comm_ != nullptr) {
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

bool NcclComm::drain_locked(Clock::time_point deadline) {
  auto nap = std::chrono::microseconds(10);
  for (;;) {
    const cudaError_t status = cudaStreamQuery(stream_.get());
    if (status == cudaSuccess) return true;
    (void)cudaGetLastError();  // "not ready" is recorded as the last error; clear it
    if (status != cudaErrorNotReady) return false;
    if (comm_ != nullptr) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return false;
      if (state != ncclSuccess && state != ncclInProgress) return false;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

void NcclComm::watchdog_loop() {
  try {
    // Otherwise this thread's first CUDA call would create a context on device 0.
    use_device(device_, context("watchdog", -1));
  } catch (const Error&) {
    // Event queries work from any device; only the stray context is lost.
  }
  std::unique_lock<std::mutex> lock(queue_mu_);
  while (!stop_) {
    if (in_flight_.empty()) {
      queue_cv_.wait(lock, [&] { return stop_ || !in_flight_.empty(); });
      continue;
    }
    lock.unlock();
    try {
      watch_once();
    } catch (const std::exception&) {
      // Only allocation can fail here; the next round tries again. Never terminate.
    }
    lock.lock();
    queue_cv_.wait_for(lock, kWatchdogPeriod, [&] { return stop_; });
  }
}

void NcclComm::watch_once() {
  std::vector<std::shared_ptr<NcclWork>> retired;
  std::shared_ptr<NcclWork> oldest;
  std::exception_ptr failure;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    // Calls finish in issue order: only the front can have finished.
    while (!in_flight_.empty() && in_flight_.front().work->finished()) {
      retired.push_back(std::move(in_flight_.front().work));
      in_flight_.pop_front();
    }
    if (in_flight_.empty() || failure_->first()) {
      // Broken: the works stay only until their kernels returned; nothing left to watch.
    } else {
      InFlight& front = in_flight_.front();
      oldest = front.work;
      const auto now = Clock::now();
      if (!front.started && front.work->started()) front.started = now;
      if (front.started && now - *front.started > front.timeout) {
        failure = std::make_exception_ptr(TimeoutError(
            oldest->context(),
            fmt::format("not completed within {} ms of starting on the GPU: a peer is hung, "
                        "dead, or issued a different call; communicator aborted",
                        front.timeout.count())));
      }
    }
  }
  for (const auto& work : retired) work->release_tensors();
  if (!oldest) return;

  std::lock_guard<std::mutex> launch_lock(launch_mu_);
  if (comm_ == nullptr) return;
  if (failure && oldest->finished()) return;  // finished while we were deciding
  if (!failure) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
    if (query != ncclSuccess) state = query;
    if (state == ncclSuccess || state == ncclInProgress) return;
    failure = std::make_exception_ptr(
        CommError(oldest->context(),
                  fmt::format("NCCL reported an asynchronous error: {}; communicator aborted",
                              nccl_reason(state, comm_))));
  }
  break_locked(failure, oldest.get());
}

}  // namespace dtrain::nccl_backend

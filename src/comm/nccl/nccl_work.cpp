#include "comm/nccl/nccl_work.h"

#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include "comm/nccl/current_stream.h"

namespace dtrain::nccl_backend {

NcclWork::NcclWork(uint64_t seq, std::string op, ErrorContext context, int device, bool blocks_host,
                   std::chrono::milliseconds host_timeout, std::vector<at::Tensor> tensors)
    : seq_(seq),
      op_(std::move(op)),
      context_(std::move(context)),
      device_(device),
      blocks_host_(blocks_host),
      host_timeout_(host_timeout),
      tensors_(std::move(tensors)) {}

void NcclWork::record_start(cudaStream_t stream) {
  start_ = make_event(context_);
  check_cuda(cudaEventRecord(start_.get(), stream), context_, "cudaEventRecord");
}

void NcclWork::record_done(cudaStream_t stream) {
  Event done = make_event(context_);
  check_cuda(cudaEventRecord(done.get(), stream), context_, "cudaEventRecord");
  done_ = std::move(done);  // set only once recorded: finished() must not see it earlier
}

bool NcclWork::reached(const Event& event) const {
  if (!event) return false;
  try {
    return event_reached(event.get(), context_);
  } catch (const CommError&) {
    // A CUDA failure (a device fault, a dead context): the call cannot finish normally.
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::current_exception();
    return true;
  }
}

bool NcclWork::started() const { return reached(start_); }

bool NcclWork::finished() const { return reached(done_); }

bool NcclWork::is_completed() const { return exception() != nullptr || finished(); }

std::exception_ptr NcclWork::exception() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void NcclWork::fail(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_) error_ = std::move(error);
}

void NcclWork::release_tensors() {
  std::vector<at::Tensor> released;
  {
    std::lock_guard<std::mutex> lock(mu_);
    released.swap(tensors_);
  }
  // Freed here, outside the lock: the allocator may take its own locks.
}

void NcclWork::synchronize() {
  if (auto error = exception()) std::rethrow_exception(error);
  if (!done_) return;  // unreachable: a work without `done` has failed
  use_device(device_, context_);
  check_cuda(cudaStreamWaitEvent(current_stream(device_), done_.get(), 0), context_,
             "cudaStreamWaitEvent");
}

void NcclWork::wait(std::chrono::milliseconds timeout) {
  synchronize();
  if (timeout.count() < 0 && !blocks_host_) return;
  const auto limit = timeout.count() < 0 ? host_timeout_ : timeout;
  const auto deadline = Clock::now() + limit;
  // Short naps first: most calls that block the host (barriers) finish within microseconds
  // once the last rank arrives.
  auto nap = std::chrono::microseconds(10);
  while (!is_completed()) {
    if (Clock::now() >= deadline) {
      throw TimeoutError(context_,
                         fmt::format("Work::wait: not completed within {} ms", limit.count()));
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
  if (auto error = exception()) std::rethrow_exception(error);
}

}  // namespace dtrain::nccl_backend

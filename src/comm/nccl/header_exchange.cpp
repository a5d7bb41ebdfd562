#include "comm/nccl/header_exchange.h"

#include <cstring>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace dtrain::nccl_backend {

using detail::CallHeader;

HeaderExchange::HeaderExchange(const ncclUniqueId& id, int rank, int world_size, int device,
                               Clock::time_point join_deadline)
    : rank_(rank), world_size_(world_size), device_(device) {
  const ErrorContext ctx{rank, world_size, "connect (headers)", -1};
  use_device(device_, ctx);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), ctx, "cudaStreamCreate");
  stream_.reset(stream);
  done_ = make_event(ctx);
  const size_t bytes = sizeof(CallHeader) * static_cast<size_t>(world_size);
  void* d = nullptr;
  check_cuda(cudaMalloc(&d, bytes), ctx, "cudaMalloc");
  device_headers_.reset(d);
  void* h = nullptr;
  check_cuda(cudaHostAlloc(&h, bytes, cudaHostAllocDefault), ctx, "cudaHostAlloc");
  host_headers_.reset(h);

  comm_ =
      init_nonblocking_comm(world_size, id, rank, join_deadline, ctx, "NCCL header communicator");
}

HeaderExchange::~HeaderExchange() {
  // Nothing is in flight between runs (each run waits for its exchange): abort is the
  // bounded way to let go of the communicator whatever the peers do.
  if (comm_ != nullptr) (void)ncclCommAbort(comm_);
}

void HeaderExchange::run(const CallHeader& mine, std::chrono::milliseconds timeout,
                         const ErrorContext& ctx) {
  if (world_size_ == 1) return;
  if (comm_ == nullptr) {
    throw CommError(ctx, "the header exchange was aborted by an earlier failure");
  }
  const auto deadline = Clock::now() + timeout;
  const size_t one = sizeof(CallHeader);
  auto* host = static_cast<char*>(host_headers_.get());
  auto* dev = static_cast<char*>(device_headers_.get());
  std::memcpy(host + static_cast<size_t>(rank_) * one, &mine, one);
  use_device(device_, ctx);
  cudaStream_t s = stream_.get();
  check_cuda(
      cudaMemcpyAsync(dev + static_cast<size_t>(rank_) * one,
                      host + static_cast<size_t>(rank_) * one, one, cudaMemcpyHostToDevice, s),
      ctx, "cudaMemcpyAsync (header)");
  ncclResult_t status = settle(
      comm_, ncclAllGather(dev + static_cast<size_t>(rank_) * one, dev, one, ncclUint8, comm_, s),
      deadline);
  bool timed_out = status == ncclInProgress;
  if (!timed_out) {
    check_nccl(status, ctx, "ncclAllGather (headers)", comm_);
    check_cuda(cudaMemcpyAsync(host, dev, one * static_cast<size_t>(world_size_),
                               cudaMemcpyDeviceToHost, s),
               ctx, "cudaMemcpyAsync (headers)");
    check_cuda(cudaEventRecord(done_.get(), s), ctx, "cudaEventRecord");
    auto nap = std::chrono::microseconds(2);
    while (!event_reached(done_.get(), ctx)) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        const std::string reason = nccl_reason(state, comm_);
        (void)ncclCommAbort(comm_);
        comm_ = nullptr;
        throw CommError(ctx, "the header exchange failed: " + reason);
      }
      if (Clock::now() >= deadline) {
        timed_out = true;
        break;
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(500));
    }
  }
  if (timed_out) {
    (void)ncclCommAbort(comm_);  // makes the stuck all-gather return
    comm_ = nullptr;
    throw TimeoutError(
        ctx, fmt::format("not every rank issued collective #{} within {} ms (slow, hung, or "
                         "they issued fewer collectives); this rank issued {}",
                         mine.sequence, timeout.count(), detail::describe(mine)));
  }
  std::vector<CallHeader> headers(static_cast<size_t>(world_size_));
  std::memcpy(headers.data(), host, one * headers.size());
  if (auto cause = detail::find_mismatch(headers)) throw DesyncError(ctx, *cause);
}

}  // namespace dtrain::nccl_backend

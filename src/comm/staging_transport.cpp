#include "comm/staging_transport.h"

#include <ATen/ATen.h>

#include <c10/util/Exception.h>

#include <fmt/format.h>

#include "comm/cpu_work.h"

namespace dtrain::detail {
namespace {

class StagingTransport final : public CollectiveEngine {
 public:
  StagingTransport(std::unique_ptr<CollectiveEngine> host, c10::Device device, int rank,
                   std::shared_ptr<StickyFailure> failure)
      : host_(std::move(host)), device_(device), rank_(rank), failure_(std::move(failure)) {}

  const char* name() const override { return host_->name(); }
  c10::Device device() const override { return device_; }

  void check_tensor(const at::Tensor& t, const ErrorContext& ctx, const char* what) const override {
    const c10::Device d = t.device();
    if (d.type() != device_.type() || (device_.has_index() && d.index() != device_.index())) {
      throw InvalidArgument(
          ctx, fmt::format("{}: the communicator takes tensors on {} (staged through host "
                           "memory), got one on {}",
                           what, device_.str(), d.str()));
    }
    // The host transport decides which dtypes it moves.
    host_->check_tensor(at::empty({0}, at::TensorOptions().dtype(t.scalar_type())), ctx, what);
  }

  void check_call(const Collective& call) const override { host_->check_call(call); }

  WorkPtr start(Collective call) override {
    if (call.op == CollectiveOp::kBarrier) return host_->start(std::move(call));
    const at::Tensor out = call.tensor;  // on device_
    bool copy_back = true;
    // The call is numbered already: a failed copy must not skip it, so it fails the call
    // and, like any transport failure, breaks the communicator.
    if (auto error = failure_->run(call.context, [&] {
          switch (call.op) {
            case CollectiveOp::kBarrier:
              break;
            case CollectiveOp::kAllReduce:
              call.tensor = to_host(call.tensor);
              break;
            case CollectiveOp::kBroadcast:
              // Only the root's value is read, and the root's tensor does not change.
              copy_back = call.root != rank_;
              call.tensor = copy_back ? host_empty(call.tensor) : to_host(call.tensor);
              break;
            case CollectiveOp::kAllGather:
            case CollectiveOp::kReduceScatter:
              call.input = to_host(call.input);
              call.tensor = host_empty(call.tensor);
              break;
          }
        })) {
      return failed(call.context, call.timeout, error);
    }
    at::Tensor host_out = call.tensor;
    WorkPtr work = host_->start(std::move(call));
    if (!copy_back) return work;
    return then(std::move(work),
                [pin = pinned(), out, host_out]() mutable { copy_from_host(out, host_out, pin); });
  }

  WorkPtr start(PointToPoint call) override {
    const at::Tensor out = call.tensor;
    if (auto error = failure_->run(call.context, [&] {
          call.tensor = call.is_send ? to_host(call.tensor) : host_empty(call.tensor);
        })) {
      return failed(call.context, call.timeout, error);
    }
    if (call.is_send) return host_->start(std::move(call));
    at::Tensor host_out = call.tensor;
    WorkPtr work = host_->start(std::move(call));
    return then(std::move(work),
                [pin = pinned(), out, host_out]() mutable { copy_from_host(out, host_out, pin); });
  }

 private:
  bool pinned() const { return device_.is_cuda(); }

  at::Tensor host_empty(const at::Tensor& like) const {
    return at::empty(like.sizes(),
                     at::TensorOptions().dtype(like.scalar_type()).pinned_memory(pinned()));
  }

  // A blocking copy: issued on the caller's current stream, after the work already queued
  // there, and complete before it returns, so the host transport reads finished data.
  at::Tensor to_host(const at::Tensor& t) const {
    at::Tensor h = host_empty(t);
    h.copy_(t, /*non_blocking=*/false);
    return h;
  }

  // On CUDA from pinned memory the copy is asynchronous on the waiting thread's current
  // stream (the caching host allocator keeps the block until it completes): later work on
  // that stream sees the result, as with NCCL's Work::wait().
  static void copy_from_host(const at::Tensor& out, const at::Tensor& host, bool pinned) {
    out.copy_(host, /*non_blocking=*/pinned);
  }

  static WorkPtr failed(const ErrorContext& ctx, std::chrono::milliseconds timeout,
                        std::exception_ptr error) {
    auto work = std::make_shared<CpuWork>(static_cast<uint64_t>(ctx.sequence), ctx.op, ctx,
                                          host_wait_bound(timeout), std::vector<at::Tensor>{});
    work->finish(std::move(error));
    return work;
  }

  std::unique_ptr<CollectiveEngine> host_;
  const c10::Device device_;
  const int rank_;
  std::shared_ptr<StickyFailure> failure_;
};

}  // namespace

std::unique_ptr<CollectiveEngine> make_staging_transport(std::unique_ptr<CollectiveEngine> host,
                                                         c10::Device device, int rank,
                                                         std::shared_ptr<StickyFailure> failure,
                                                         const ErrorContext& ctx) {
  auto unusable = [&](const std::string& why) {
    return InvalidArgument(
        ctx, fmt::format("device {} is not usable in this LibTorch: {}", device.str(), why));
  };
  try {
    (void)at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  } catch (const c10::Error& e) {
    throw unusable(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw unusable(e.what());
  }
  return std::make_unique<StagingTransport>(std::move(host), device, rank, std::move(failure));
}

}  // namespace dtrain::detail

#include "comm/shm/shm_transport.h"

#include <ATen/ATen.h>

#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/reduce/reduce_ops.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/barrier.h"
#include "comm/shm/call_runner.h"
#include "comm/shm/host.h"
#include "comm/shm/segment.h"

namespace dtrain::shm {
namespace {

using detail::Collective;
using detail::CollectiveOp;
using detail::PointToPoint;

class ShmTransport final : public detail::CollectiveEngine {
 public:
  ShmTransport(Segment segment, std::shared_ptr<Store> store, int rank, int world_size,
               std::shared_ptr<detail::StickyFailure> failure,
               std::shared_ptr<detail::WireCounter> wire,
               std::unique_ptr<detail::CollectiveEngine> p2p)
      : rank_(rank),
        world_size_(world_size),
        store_(std::move(store)),
        failure_(std::move(failure)),
        wire_{std::move(wire), std::vector<int>(static_cast<size_t>(world_size), 0)},
        p2p_(std::move(p2p)),
        segment_(std::move(segment)),
        barrier_(segment_, rank),
        calls_(barrier_, *failure_, *p2p_, [this](const Collective& call) { run(call); }) {}

  const char* name() const override { return "shared_memory"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void check_tensor(const at::Tensor& t, const ErrorContext& ctx, const char* what) const override {
    p2p_->check_tensor(t, ctx, what);
  }
  void check_call(const Collective& call) const override { p2p_->check_call(call); }

  WorkPtr start(Collective call) override { return calls_.start(std::move(call)); }
  WorkPtr start(PointToPoint call) override { return calls_.start(std::move(call)); }

 private:
  // Executor thread: the header check, then the data. Throws on failure.
  void run(const Collective& call) {
    const auto deadline = Clock::now() + call.timeout;
    const auto seq = static_cast<uint64_t>(call.context.sequence);
    wire_.shared(detail::WireKind::kControl, sizeof(detail::CallHeader));
    check_headers(segment_, barrier_, rank_, call, deadline);

    Steps steps(segment_, barrier_, rank_, sets_used_, deadline, call.timeout,
                fmt::format("{} #{}", detail::to_string(call.op), seq));
    steps.count_in(wire_, detail::wire_kind(call.op));
    switch (call.op) {
      case CollectiveOp::kAllReduce:
        all_reduce(steps, call.tensor, reduce::reduce_fn(call.tensor.scalar_type(), call.reduce));
        if (call.reduce == ReduceOp::kAvg) call.tensor.div_(world_size_);
        return;
      case CollectiveOp::kReduceScatter:
        reduce_scatter(steps, call.tensor, call.input,
                       reduce::reduce_fn(call.input.scalar_type(), call.reduce));
        if (call.reduce == ReduceOp::kAvg) call.tensor.div_(world_size_);
        return;
      case CollectiveOp::kAllGather:
        all_gather(steps, call.tensor, call.input);
        return;
      case CollectiveOp::kBroadcast:
        broadcast(steps, call.tensor, call.root);
        return;
      case CollectiveOp::kBarrier:
        return;  // the header barrier is the barrier
    }
  }

  const int rank_;
  const int world_size_;
  // Kept for the communicator's lifetime (rank 0's may host the TCP store server).
  std::shared_ptr<Store> store_;
  std::shared_ptr<detail::StickyFailure> failure_;
  const detail::WireTally wire_;  // one host
  std::unique_ptr<detail::CollectiveEngine> p2p_;
  Segment segment_;
  Barrier barrier_;
  uint64_t sets_used_ = 0;  // executor thread only
  CallRunner calls_;        // last: destroyed first, see call_runner.h
};

}  // namespace

std::unique_ptr<detail::CollectiveEngine> make_shm_transport(
    Segment segment, std::shared_ptr<Store> store, int rank, int world_size,
    std::shared_ptr<detail::StickyFailure> failure, std::shared_ptr<detail::WireCounter> wire,
    std::unique_ptr<detail::CollectiveEngine> p2p) {
  return std::make_unique<ShmTransport>(std::move(segment), std::move(store), rank, world_size,
                                        std::move(failure), std::move(wire), std::move(p2p));
}

}  // namespace dtrain::shm

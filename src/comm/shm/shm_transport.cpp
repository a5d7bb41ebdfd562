#include "comm/shm/shm_transport.h"

#include <ATen/ATen.h>

#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/cpu_work.h"
#include "comm/gloo/reduce_ops.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/barrier.h"
#include "comm/shm/host.h"
#include "comm/shm/segment.h"

namespace dtrain::shm {
namespace {

using detail::Collective;
using detail::CollectiveOp;
using detail::CpuWork;
using detail::PointToPoint;

class ShmTransport final : public detail::Transport {
 public:
  ShmTransport(Segment segment, std::shared_ptr<Store> store, int rank, int world_size,
               std::shared_ptr<detail::StickyFailure> failure,
               std::unique_ptr<detail::Transport> p2p)
      : rank_(rank),
        world_size_(world_size),
        store_(std::move(store)),
        failure_(std::move(failure)),
        p2p_(std::move(p2p)),
        segment_(std::move(segment)),
        barrier_(segment_, rank),
        p2p_waiter_(std::make_unique<detail::SerialExecutor>()),
        executor_(std::make_unique<detail::SerialExecutor>()) {}

  ~ShmTransport() override {
    executor_.reset();
    p2p_waiter_.reset();
    // Peers that wait for this rank from now on fail at once instead of at their timeout.
    barrier_.set_state(RankState::kLeft);
  }

  Backend backend() const override { return Backend::kGloo; }
  const char* name() const override { return "shared_memory"; }
  void check_tensor(const at::Tensor& t, const ErrorContext& ctx, const char* what) const override {
    p2p_->check_tensor(t, ctx, what);
  }
  void check_call(const Collective& call) const override { p2p_->check_call(call); }

  WorkPtr start(Collective call) override {
    std::vector<at::Tensor> keep{call.tensor, call.input};
    auto work = std::make_shared<CpuWork>(static_cast<uint64_t>(call.context.sequence),
                                          call.context.op, call.context,
                                          detail::host_wait_bound(call.timeout), std::move(keep));
    executor_->submit([this, work, call = std::move(call)] {
      work->finish(failure_->run(call.context, [&] {
        try {
          run(call);
        } catch (...) {
          barrier_.set_state(RankState::kFailed);
          throw;
        }
      }));
    });
    return work;
  }

  // Posted from the executor, after the collectives issued before it, then completed on a
  // second thread, as the Gloo transport does.
  WorkPtr start(PointToPoint call) override {
    auto work = std::make_shared<CpuWork>(
        static_cast<uint64_t>(call.context.sequence), call.context.op, call.context,
        detail::host_wait_bound(call.timeout), std::vector<at::Tensor>{call.tensor});
    executor_->submit([this, work, call = std::move(call)]() mutable {
      WorkPtr inner = p2p_->start(std::move(call));
      p2p_waiter_->submit([this, work, inner] {
        try {
          inner->wait();
          work->finish();
        } catch (...) {
          // The communicator is broken (sticky): peers waiting in a collective for this rank
          // learn it now instead of at their timeout.
          barrier_.set_state(RankState::kFailed);
          work->finish(std::current_exception());
        }
      });
    });
    return work;
  }

 private:
  // Executor thread: the header check, then the data. Throws on failure.
  void run(const Collective& call) {
    const auto deadline = Clock::now() + call.timeout;
    const auto seq = static_cast<uint64_t>(call.context.sequence);
    check_headers(segment_, barrier_, rank_, call, deadline);

    Steps steps(segment_, barrier_, rank_, sets_used_, deadline, call.timeout,
                fmt::format("{} #{}", detail::to_string(call.op), seq));
    switch (call.op) {
      case CollectiveOp::kAllReduce:
        all_reduce(steps, call.tensor, gloo_backend::reduce_fn(call.tensor.scalar_type(), call.reduce));
        if (call.reduce == ReduceOp::kAvg) call.tensor.div_(world_size_);
        return;
      case CollectiveOp::kReduceScatter:
        reduce_scatter(steps, call.tensor, call.input,
                       gloo_backend::reduce_fn(call.input.scalar_type(), call.reduce));
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
  std::unique_ptr<detail::Transport> p2p_;
  Segment segment_;
  Barrier barrier_;
  uint64_t sets_used_ = 0;  // executor thread only

  // Declared last: destroyed first, so queued calls finish while members above live.
  std::unique_ptr<detail::SerialExecutor> p2p_waiter_;
  std::unique_ptr<detail::SerialExecutor> executor_;
};

}  // namespace

std::unique_ptr<detail::Transport> make_shm_transport(
    Segment segment, std::shared_ptr<Store> store, int rank, int world_size,
    std::shared_ptr<detail::StickyFailure> failure, std::unique_ptr<detail::Transport> p2p) {
  return std::make_unique<ShmTransport>(std::move(segment), std::move(store), rank, world_size,
                                        std::move(failure), std::move(p2p));
}

}  // namespace dtrain::shm

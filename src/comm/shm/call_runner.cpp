#include "comm/shm/call_runner.h"

#include <utility>
#include <vector>

namespace dtrain::shm {

using detail::CpuWork;

CallRunner::CallRunner(Barrier& barrier, detail::StickyFailure& failure,
                       detail::CollectiveEngine& p2p,
                       std::function<void(const detail::Collective&)> run)
    : barrier_(barrier),
      failure_(failure),
      p2p_(p2p),
      run_(std::move(run)),
      p2p_waiter_(std::make_unique<detail::SerialExecutor>()),
      executor_(std::make_unique<detail::SerialExecutor>()) {}

CallRunner::~CallRunner() {
  executor_.reset();
  p2p_waiter_.reset();
  barrier_.set_state(RankState::kLeft);
}

WorkPtr CallRunner::start(detail::Collective call) {
  std::vector<at::Tensor> keep{call.tensor, call.input};
  auto work = std::make_shared<CpuWork>(static_cast<uint64_t>(call.context.sequence),
                                        call.context.op, call.context,
                                        detail::host_wait_bound(call.timeout), std::move(keep));
  executor_->submit([this, work, call = std::move(call)] {
    work->finish(failure_.run(call.context, [&] {
      try {
        run_(call);
      } catch (...) {
        barrier_.set_state(RankState::kFailed);
        throw;
      }
    }));
  });
  return work;
}

WorkPtr CallRunner::start(detail::PointToPoint call) {
  auto work = std::make_shared<CpuWork>(
      static_cast<uint64_t>(call.context.sequence), call.context.op, call.context,
      detail::host_wait_bound(call.timeout), std::vector<at::Tensor>{call.tensor});
  executor_->submit([this, work, call = std::move(call)]() mutable {
    WorkPtr inner = p2p_.start(std::move(call));
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

}  // namespace dtrain::shm

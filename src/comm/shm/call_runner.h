// How the shared-memory and the hierarchical transports run their calls. Collectives run one
// at a time on an executor thread, in issue order, through the transport's `run`; one that
// fails marks this rank failed in the segment, so that peers waiting for it fail at once
// instead of at their timeout. Send/recv go through `p2p` (Gloo), posted from the same
// executor so that they keep their order relative to collectives, and are completed on a
// second thread. A transport declares its CallRunner last: destroyed first, it finishes the
// queued calls while what `run` uses still exists, then marks the rank as left.
#pragma once

#include <functional>
#include <memory>

#include "comm/cpu_work.h"
#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/shm/barrier.h"

namespace dtrain::shm {

class CallRunner {
 public:
  // `run` moves one collective's data on the executor thread and throws on failure.
  CallRunner(Barrier& barrier, detail::StickyFailure& failure, detail::CollectiveEngine& p2p,
             std::function<void(const detail::Collective&)> run);
  // Finishes the queued calls, then tells peers this rank left (they fail at once).
  ~CallRunner();
  CallRunner(const CallRunner&) = delete;
  CallRunner& operator=(const CallRunner&) = delete;

  WorkPtr start(detail::Collective call);
  WorkPtr start(detail::PointToPoint call);

 private:
  Barrier& barrier_;
  detail::StickyFailure& failure_;
  detail::CollectiveEngine& p2p_;
  const std::function<void(const detail::Collective&)> run_;
  std::unique_ptr<detail::SerialExecutor> p2p_waiter_;
  std::unique_ptr<detail::SerialExecutor> executor_;
};

}  // namespace dtrain::shm

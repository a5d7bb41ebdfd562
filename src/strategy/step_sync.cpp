#include "strategy/step_sync.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/control_plane.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

constexpr size_t kMessageBytes = 384;  // of a failing rank's what(), sent to its peers

// "the start of step 12", "the end of backward of step 12", ...
std::string point_name(int64_t p, int64_t step) {
  switch (static_cast<StepSync::Point>(p)) {
    case StepSync::Point::kStart:
      return fmt::format("the start of step {}", step);
    case StepSync::Point::kFinish:
      return fmt::format("finish() at step {}", step);
    case StepSync::Point::kForwardEnd:
      return fmt::format("the end of the evaluation forward of step {}", step);
    case StepSync::Point::kBackwardEnd:
      return fmt::format("the end of backward of step {}", step);
  }
  return fmt::format("an unknown point of step {}", step);
}

std::string ranks_text(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

}  // namespace

std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

StepSync::StepSync(CommunicatorPtr comm, std::string strategy, StepChecks checks)
    : comm_(std::move(comm)),
      strategy_(std::move(strategy)),
      // A null communicator is the strategy's to refuse; an agreement on the CPU or among
      // one rank costs no wait for a device.
      every_step_(checks == StepChecks::kEveryStep || !comm_ || comm_->world_size() == 1 ||
                  comm_->device().is_cpu()) {}

std::exception_ptr StepSync::alone(const char* op, std::exception_ptr local) {
  if (!local) return nullptr;
  // The peers cannot learn of it in this step: this rank stops issuing collectives, so
  // theirs fail within the communicator's timeout instead of pairing with the wrong calls.
  break_with(op,
             "it failed in a step without per-step agreements (StepChecks::kAuto on a "
             "device; kEveryStep keeps the strategy usable after a failure)",
             local);
  return local;
}

ErrorContext StepSync::ctx(const char* op) const {
  return ErrorContext{comm_->rank(), comm_->world_size(), op, -1};
}

void StepSync::check_usable(const char* /*op*/) const {
  if (broken_) std::rethrow_exception(broken_);
}

std::exception_ptr StepSync::break_with(const char* op, const std::string& why,
                                        std::exception_ptr cause) {
  if (!broken_) {
    broken_ = std::make_exception_ptr(
        CommError(ctx(op), fmt::format("{} is unusable since step {}: {}: {}", strategy_, step_,
                                       why, cause ? describe(cause) : std::string("no cause"))));
  }
  return broken_;
}

StepSync::Table StepSync::exchange(Point point, const char* op, bool failed) {
  const std::vector<int64_t> mine = {static_cast<int64_t>(point), step_, int64_t{failed}};
  Table table;
  try {
    table.cells = ControlPlane(*comm_).all_gather(mine);
  } catch (...) {
    std::rethrow_exception(break_with(
        op,
        fmt::format("the ranks did not meet at {} (a rank that failed, exited or ran out of data "
                    "without calling finish() leaves the others here)",
                    point_name(static_cast<int64_t>(point), step_)),
        std::current_exception()));
  }
  return table;
}

void StepSync::start_step(const char* op) {
  check_usable(op);
  ++step_;
  if (!every_step_) return;
  const Table table = exchange(Point::kStart, op, false);
  std::vector<int> with, without, elsewhere;
  for (int r = 0; r < table.rows(); ++r) {
    const int64_t p = table(r, 0);
    (p == static_cast<int64_t>(Point::kStart)    ? with
     : p == static_cast<int64_t>(Point::kFinish) ? without
                                                 : elsewhere)
        .push_back(r);
  }
  if (!elsewhere.empty()) {
    std::rethrow_exception(break_with(
        op, "ranks out of step",
        std::make_exception_ptr(Error(fmt::format(
            "{} started step {} while {} reached {}", ranks_text(with), step_,
            ranks_text(elsewhere), point_name(table(elsewhere[0], 0), table(elsewhere[0], 1)))))));
  }
  if (!without.empty()) {
    throw InvalidArgument(ctx(op), fmt::format("{} had no batch at step {} while {} did",
                                               ranks_text(without), step_, ranks_text(with)));
  }
}

void StepSync::finish() {
  check_usable("finish");
  ++step_;
  const Table table = exchange(Point::kFinish, "finish", false);
  std::vector<int> with, without;
  for (int r = 0; r < table.rows(); ++r) {
    (table(r, 0) == static_cast<int64_t>(Point::kFinish) ? without : with).push_back(r);
  }
  --step_;  // finish() is not a step: a later forward() starts this one
  if (!with.empty()) {
    throw InvalidArgument(
        ctx("finish"), fmt::format("{} had no batch at step {} while {} did", ranks_text(without),
                                   step_ + 1, ranks_text(with)));
  }
}

std::exception_ptr StepSync::agree(Point point, const char* op, std::exception_ptr local) {
  if (!every_step_) return alone(op, local);
  const Table table = exchange(point, op, static_cast<bool>(local));
  const int world = static_cast<int>(table.rows());
  std::vector<int> failed, elsewhere;
  for (int r = 0; r < world; ++r) {
    if (table(r, 0) != static_cast<int64_t>(point) || table(r, 1) != step_) {
      elsewhere.push_back(r);
    }
    if (table(r, 2) != 0) failed.push_back(r);
  }
  if (!elsewhere.empty()) {
    return break_with(op, "ranks out of step",
                      std::make_exception_ptr(Error(fmt::format(
                          "rank {} reached {} while {} reached {}", comm_->rank(),
                          point_name(static_cast<int64_t>(point), step_), ranks_text(elsewhere),
                          point_name(table(elsewhere[0], 0), table(elsewhere[0], 1))))));
  }
  if (failed.empty()) return nullptr;
  // Every rank learns the first failing rank's message: one more exchange, on failure only.
  std::vector<uint8_t> message(kMessageBytes, 0);  // NUL-terminated, fixed size
  if (local) {
    const std::string what = describe(local);
    std::copy_n(what.begin(), std::min(what.size(), kMessageBytes - 1), message.begin());
  }
  std::vector<uint8_t> messages;
  try {
    messages = ControlPlane(*comm_).all_gather(message);
  } catch (...) {
    return break_with(op, "the failure report did not reach every rank", std::current_exception());
  }
  if (local) return local;
  const int first = failed.front();
  return std::make_exception_ptr(StepError(
      ctx(op),
      fmt::format("step {} failed on {}: {}; the step was dropped on every rank and the "
                  "strategy is ready for the next one",
                  step_, ranks_text(failed),
                  reinterpret_cast<const char*>(messages.data()) + first * kMessageBytes)));
}

}  // namespace dtrain

#include "strategy/step_sync.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
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
    case StepSync::Point::kStartEvaluation:
      return fmt::format("the start of the evaluation forward of step {}", step);
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

StepSync::StepSync(CommunicatorPtr comm, std::string strategy, StepFailure& failure,
                   StepChecks checks)
    : comm_(std::move(comm)),
      strategy_(std::move(strategy)),
      failure_(failure),
      // A null communicator is one rank; an agreement on the CPU or among one rank costs no
      // wait for a device.
      every_step_(checks == StepChecks::kEveryStep || !comm_ || comm_->world_size() == 1 ||
                  comm_->device().is_cpu()),
      // A null communicator is a single rank (SingleDevice).
      rank_(comm_ ? comm_->rank() : 0),
      world_size_(comm_ ? comm_->world_size() : 1) {}

StepSync::~StepSync() {
  if (!trained_since_finish_ || failure_.broken() || step_failed_ ||
      std::uncaught_exceptions() > 0 || world_size_ < 2) {
    return;
  }
  try {
    TORCH_WARN("dtrain ", strategy_, " (rank ", rank_, " of ", world_size_,
               ") destroyed after training steps without finish(): call strategy->finish() on "
               "every rank after its last batch (and before evaluating); with uneven data it is "
               "what reports that a rank ran out of batches");
  } catch (...) {
    // a warning handler that throws (warnings as errors) must not end the process here
  }
}

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
  return ErrorContext{rank_, world_size_, op, -1};
}

StepSync::Table StepSync::exchange(Point point, const char* op, bool failed) {
  const std::vector<int64_t> mine = {static_cast<int64_t>(point), step_, int64_t{failed}};
  Table table;
  try {
    table.cells = comm_ ? ControlPlane(*comm_).all_gather(mine) : mine;
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

void StepSync::start_step(const char* op, std::exception_ptr local) {
  check_usable(op);
  ++step_;
  step_failed_ = false;
  const bool training = c10::GradMode::is_enabled();
  if (!every_step_) {
    // No agreement: neither a rank's refusal nor a training/evaluation mix reaches the peers.
    if (auto failure = alone(op, local)) std::rethrow_exception(failure);
    if (training) trained_since_finish_ = true;
    return;
  }
  const Table table =
      exchange(training ? Point::kStart : Point::kStartEvaluation, op, static_cast<bool>(local));
  std::vector<int> with, without, elsewhere, trains, evaluates;
  for (int r = 0; r < table.rows(); ++r) {
    const auto p = static_cast<Point>(table(r, 0));
    if (p == Point::kStart || p == Point::kStartEvaluation) {
      with.push_back(r);
      (p == Point::kStart ? trains : evaluates).push_back(r);
    } else {
      (p == Point::kFinish ? without : elsewhere).push_back(r);
    }
  }
  if (!elsewhere.empty()) {
    std::rethrow_exception(break_with(
        op, "ranks out of step",
        std::make_exception_ptr(Error(fmt::format(
            "{} started step {} while {} reached {}", ranks_text(with), step_,
            ranks_text(elsewhere), point_name(table(elsewhere[0], 0), table(elsewhere[0], 1)))))));
  }
  step_failed_ = !without.empty() || (!trains.empty() && !evaluates.empty());
  if (!without.empty()) {
    throw InvalidArgument(ctx(op), fmt::format("{} had no batch at step {} while {} did",
                                               ranks_text(without), step_, ranks_text(with)));
  }
  if (auto failure = verdict(table, op, local)) std::rethrow_exception(failure);
  // Nothing of the step was issued yet: every rank throws here and the strategy stays usable.
  if (!trains.empty() && !evaluates.empty()) {
    throw InvalidArgument(
        ctx(op), fmt::format("{} ran an evaluation forward at step {} while {} ran a training "
                             "step (grad mode on): a rank out of data must call finish() before "
                             "evaluating, and every rank must evaluate together",
                             ranks_text(evaluates), step_, ranks_text(trains)));
  }
  if (training) trained_since_finish_ = true;
}

void StepSync::finish() {
  check_usable("finish");
  ++step_;
  const Table table = exchange(Point::kFinish, "finish", false);
  std::vector<int> with, without;
  for (int r = 0; r < table.rows(); ++r) {
    (table(r, 0) == static_cast<int64_t>(Point::kFinish) ? without : with).push_back(r);
  }
  --step_;                        // finish() is not a step: a later forward() starts this one
  trained_since_finish_ = false;  // also when it throws: the mistake is reported
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
  std::vector<int> elsewhere;
  for (int r = 0; r < world; ++r) {
    if (table(r, 0) != static_cast<int64_t>(point) || table(r, 1) != step_) {
      elsewhere.push_back(r);
    }
  }
  if (!elsewhere.empty()) {
    return break_with(op, "ranks out of step",
                      std::make_exception_ptr(Error(fmt::format(
                          "rank {} reached {} while {} reached {}", rank_,
                          point_name(static_cast<int64_t>(point), step_), ranks_text(elsewhere),
                          point_name(table(elsewhere[0], 0), table(elsewhere[0], 1))))));
  }
  return verdict(table, op, local);
}

std::exception_ptr StepSync::verdict(const Table& table, const char* op, std::exception_ptr local) {
  std::vector<int> failed;
  for (int r = 0; r < table.rows(); ++r) {
    if (table(r, 2) != 0) failed.push_back(r);
  }
  if (failed.empty()) return nullptr;
  step_failed_ = true;
  // Every rank learns the first failing rank's message: one more exchange, on failure only.
  std::vector<uint8_t> message(kMessageBytes, 0);  // NUL-terminated, fixed size
  if (local) {
    const std::string what = describe(local);
    std::copy_n(what.begin(), std::min(what.size(), kMessageBytes - 1), message.begin());
  }
  std::vector<uint8_t> messages;
  try {
    messages = comm_ ? ControlPlane(*comm_).all_gather(message) : message;
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

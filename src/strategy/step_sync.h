// Step agreements: how the ranks of a strategy stay in step when one of them fails or runs
// out of data.
//
// A rank can only learn about another rank's trouble through a collective that both issue at
// the same point of their collective streams. StepSync owns those points: a tiny all-gather
// (3 int64 per rank) at the start of every forward(), at the end of every backward() and at
// the end of an evaluation forward (grad mode off), plus finish(). Every rank reads the same
// table, so every rank reaches the same verdict: all go on, all throw, or all break.
//
// Policy (StepChecks, dtrain/strategy.h): where an agreement would make the host wait for the
// device (the communicator's device is not the CPU, more than one rank) and the strategy did
// not ask for kEveryStep, the per-step agreements are skipped: start_step() and agree() then
// exchange nothing, and a local failure breaks this rank (its peers fail at their next
// collective, within the communicator's timeout) while agree() returns it to be thrown.
// finish() always agrees.
//
// A failed agreement breaks the strategy through its StepFailure (strategy/step_failure.h),
// the one failure state the StepDriver owns. A null communicator is a single rank: the
// agreements then exchange nothing and see only this rank's row.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/strategy.h"
#include "strategy/step_failure.h"

namespace dtrain {

class StepSync {
 public:
  // Where in a step an agreement is; ranks at different points are out of step.
  // kStart begins a training step (grad mode on), kStartEvaluation an evaluation forward.
  enum class Point : int64_t {
    kStart = 1,
    kFinish = 2,
    kForwardEnd = 3,
    kBackwardEnd = 4,
    kStartEvaluation = 5,
  };

  // The agreements go through the control plane (comm/control_plane.h): on the
  // communicator's device.
  // Breaks through `failure`, which must outlive it.
  StepSync(CommunicatorPtr comm, std::string strategy, StepFailure& failure,
           StepChecks checks = StepChecks::kAuto);
  // Warns once (TORCH_WARN) when training steps ran since the last finish() at world size > 1:
  // forgetting finish() goes unnoticed with even data, and uneven data then fails far from its
  // cause. Not while an exception unwinds, nor after a step failed or the strategy broke.
  ~StepSync();
  StepSync(const StepSync&) = delete;
  StepSync& operator=(const StepSync&) = delete;

  // Whether start_step() and agree() exchange anything (see the policy above).
  bool agrees_every_step() const { return every_step_; }

  // Index of the current step (forward() calls, from 0), for messages.
  int64_t step() const { return step_; }
  bool broken() const { return failure_.broken(); }

  // Throws the sticky CommError when broken.
  void check_usable(const char* /*op*/) const { failure_.check_usable(); }

  // Start of a forward(): every rank must be starting the same step. Throws InvalidArgument
  // on every rank when some called finish() instead ("rank 1 had no batch at step 12 while
  // rank 0 did"), or when some start a training step (grad mode on) and others an evaluation
  // forward ("rank 1 ran an evaluation forward at step 27 while rank 0 ran a training step");
  // a failed agreement (peer gone, timeout) breaks. `local`: this rank refuses to start (a
  // misuse found before any collective of the step); every rank then throws, the refusing
  // rank its own exception, the others a StepError naming it, and the strategy stays usable.
  void start_step(const char* op, std::exception_ptr local = nullptr);

  // A rank with no more data: the same agreement with "no batch". Returns once every rank
  // called finish(); throws like start_step() when some rank is still stepping.
  void finish();

  // End of a step (or of an evaluation forward): `local` is this rank's failure in the step,
  // or null. Returns null when no rank failed. Otherwise returns what this rank must throw once
  // its state is reset: its own exception, or a StepError naming the first failing rank and
  // that rank's message. Throws (and breaks) when the agreement itself fails.
  std::exception_ptr agree(Point point, const char* op, std::exception_ptr local);

 private:
  // StepFailure::break_with at this step.
  std::exception_ptr break_with(const char* op, const std::string& why, std::exception_ptr cause) {
    return failure_.break_with(op, step_, why, std::move(cause));
  }
  ErrorContext ctx(const char* op) const;
  // Every rank's [point, step, failed] row.
  struct Table {
    std::vector<int64_t> cells;  // row-major
    int rows() const { return static_cast<int>(cells.size() / 3); }
    int64_t operator()(int r, int c) const { return cells[static_cast<size_t>(r * 3 + c)]; }
  };
  // Issues the agreement and returns the table.
  Table exchange(Point point, const char* op, bool failed);
  // The verdict on a table whose ranks agree on the point: null when no rank failed, else
  // what this rank throws (one more exchange carries the first failing rank's message).
  std::exception_ptr verdict(const Table& table, const char* op, std::exception_ptr local);

  // Without per-step agreements: breaks on a local failure and returns it.
  std::exception_ptr alone(const char* op, std::exception_ptr local);

  CommunicatorPtr comm_;
  std::string strategy_;
  StepFailure& failure_;
  bool every_step_;
  int64_t step_ = -1;
  int rank_, world_size_;  // for the destructor's warning (a borrowed communicator may be gone)
  bool trained_since_finish_ = false;  // a training step started since finish()
  bool step_failed_ = false;           // the last agreement reported a failure
};

}  // namespace dtrain

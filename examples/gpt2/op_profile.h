// Per-operator CPU time of a stretch of training, from ATen's RecordFunction observers: the
// same events torch.autograd.profiler.profile() records in Python, so names match between a
// dtrain profile and a PyTorch one (benchmarks/peer-profile.sh puts them side by side).
//
//   OpProfile profile;
//   for (...) {
//     std::optional<OpRecorder> rec;
//     if (profiled) rec.emplace(profile);   // ops of this thread now count
//     const auto t0 = Clock::now();
//     ... one training step ...
//     const double wall = seconds_since(t0);
//     rec.reset();                          // stop recording
//     profile.add_step(wall);
//   }
//   profile.write_json("profile.json");
//
// Self time. Every recorded event is timed from its start to its end callback (inclusive
// time, `total_s`). RecordFunction events on one thread nest strictly (each is a scope
// guard), so a thread-local stack of open events sees each event end before its parent does;
// the ending event adds its inclusive time to the parent's "children" time, and its self
// time is inclusive minus children. Both kinds of event are recorded and nest with each
// other:
//   - RecordScope::FUNCTION: every ATen operator called through the dispatcher (aten::addmm
//     inside aten::linear inside ...), and the autograd engine's
//     "autograd::engine::evaluate_function: <Node>" around each backward node, and
//   - RecordScope::BACKWARD_FUNCTION: the backward node itself (e.g. AddmmBackward0), whose
//     kernels (aten::mm, aten::sum ...) are FUNCTION events nested inside it.
// So a backward node's self time is only its own bookkeeping, its kernels are charged to
// the kernels' names, and the sum of self times over all names is the time spent inside
// recorded events, counted once. What is outside every event (the caller's own code between
// operators: an interpreter, a training loop, a communication wait) is wall time minus that
// sum. Python's profiler computes self time the same way (children by time containment on
// the same thread); user ranges (RecordScope::USER_SCOPE, e.g. Python's
// "Optimizer.step#AdamW.step") are not recorded here, their time counts as outside.
//
// Threads. Only the thread that created the OpRecorder is recorded. On CPU that covers a
// whole training step: the autograd engine runs CPU backward on the thread that calls
// backward(), and intra-op (OpenMP) workers run parts of the calling operator's kernel, whose
// time is already in that operator's. Not recorded: operators on other threads (a
// communicator's thread; on CUDA, the engine's per-device backward threads).
//
// Cost. Nothing is registered with ATen unless an OpRecorder is alive: with profiling off
// there is no observer and operators take their ordinary path. While recording, each event
// costs two clock reads, a push and pop on the thread's stack and a hash-map update keyed by
// name. A GPT-2 tiny step has about 11,000 events; its profiled steps stayed within the
// run-to-run noise (about 1%) of the unprofiled ones. The callbacks' own time between
// two clock reads lands in the enclosing event's self time (or outside, at top level).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gpt2 {

// Time of one operator name, summed over its calls.
struct OpStats {
  int64_t calls = 0;
  double self_s = 0;  // inclusive minus the time of events nested in it
  // Inclusive: start to end of each call. Summed per call, so an operator that calls an
  // overload of the same name (LibTorch's Tensor::norm() -> aten::norm -> aten::norm) counts
  // the inner call's time twice here; self_s never double-counts.
  double total_s = 0;
};

// Per-operator totals collected by OpRecorder, plus the profiled steps and their wall time.
// Not thread-safe: it is filled by the one thread that records into it.
class OpProfile {
 public:
  // Counts one profiled step that took `wall_s` (the caller's own measure of the step).
  void add_step(double wall_s);
  // Adds one finished call of `name` (used by OpRecorder).
  void add_call(const char* name, double self_s, double total_s);

  int64_t steps() const { return steps_; }
  double wall_s() const { return wall_s_; }
  const std::unordered_map<std::string, OpStats>& ops() const { return ops_; }
  // The operators by self time, largest first (ties by name).
  std::vector<std::pair<std::string, OpStats>> sorted() const;

  // {"steps": N, "wall_s": total wall time of the profiled steps, "ops": [{"name", "calls",
  // "self_s", "total_s"}, ...]} with the ops by self time, largest first. Throws
  // dtrain::Error when the file cannot be written.
  void write_json(const std::string& path) const;

 private:
  int64_t steps_ = 0;
  double wall_s_ = 0;
  std::unordered_map<std::string, OpStats> ops_;
};

// While alive, adds every ATen operator and autograd node that runs on the constructing
// thread to `into` (see the top of this file). Construct and destroy it on the same thread,
// outside any operator (between steps). `into` must outlive it.
//
// ATen's observer callbacks are plain function pointers without user data, and a callback
// added with at::addGlobalCallback runs for events on every thread. So the recording target
// is reached through a thread-local pointer that this object sets on its own thread (other
// threads see null and return at once), and one process-wide flag allows one OpRecorder at a
// time: two registrations would each see the same thread-local target and count every
// event twice. Constructing a second one while one is alive throws dtrain::InvalidArgument.
class OpRecorder {
 public:
  explicit OpRecorder(OpProfile& into);
  ~OpRecorder();
  OpRecorder(const OpRecorder&) = delete;
  OpRecorder& operator=(const OpRecorder&) = delete;

 private:
  uint64_t handle_ = 0;  // at::CallbackHandle
};

}  // namespace gpt2

// Counts the ATen operators a piece of code calls, as torch.profiler lists them: outermost
// calls only (an operator called from inside another, e.g. the per-tensor kernels of a
// foreach operator's CPU path or the fake device's copies, is not counted), so on a GPU each
// is about one kernel launch. Through LibTorch's RecordFunction callbacks.
//
//   OpCounter count;           // counts from here ...
//   opt.step();
//   int64_t n = count.total(); // ... to here; count.by_name() for the breakdown
//
// What is counted: events named "aten::..." with no enclosing "aten::" event on their
// thread. Other events (the autograd engine's "autograd::engine::evaluate_function: ..."
// around each backward node) are neither counted nor hide the operators inside them.
// Threads: the callback is thread-local, and LibTorch hands a thread's RecordFunction
// callbacks to the autograd engine's worker threads that run its backward (a device's
// backward runs on one), so backward on the fake device is counted too; the counts of all
// these threads go into one table. One OpCounter at a time per process.
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace dtrain::testing {

class OpCounter {
 public:
  OpCounter() {
    {
      std::lock_guard<std::mutex> lock(shared().mu);
      shared().counts.clear();
    }
    depth() = 0;
    handle_ =
        at::addThreadLocalCallback(at::RecordFunctionCallback(&OpCounter::enter, &OpCounter::leave)
                                       .scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounter() { at::removeCallback(handle_); }
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;

  int64_t total() const {
    int64_t n = 0;
    for (const auto& [name, c] : by_name()) n += c;
    return n;
  }
  // A copy: worker threads may still be adding to the table.
  std::map<std::string, int64_t> by_name() const {
    std::lock_guard<std::mutex> lock(shared().mu);
    return shared().counts;
  }

 private:
  struct Shared {
    std::mutex mu;
    std::map<std::string, int64_t> counts;
  };
  static Shared& shared() {
    static Shared s;
    return s;
  }
  // Open "aten::" events on this thread.
  static int& depth() {
    static thread_local int d = 0;
    return d;
  }
  static bool is_operator(const at::RecordFunction& fn) {
    return std::strncmp(fn.name(), "aten::", 6) == 0;
  }
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    if (!is_operator(fn)) return nullptr;
    if (depth()++ == 0) {
      std::lock_guard<std::mutex> lock(shared().mu);
      ++shared().counts[fn.name()];
    }
    return nullptr;
  }
  static void leave(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
    if (is_operator(fn)) --depth();
  }

  at::CallbackHandle handle_;
};

}  // namespace dtrain::testing

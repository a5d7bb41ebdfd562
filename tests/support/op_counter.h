// Counts the ATen operators a piece of code calls on this thread, as torch.profiler lists
// them: outermost calls only (an operator called from inside another, e.g. the per-tensor
// kernels of a foreach operator's CPU path or the fake device's copies, is not counted), so
// on a GPU each is about one kernel launch. Through LibTorch's RecordFunction callbacks.
//
//   OpCounter count;           // counts from here ...
//   opt.step();
//   int64_t n = count.total(); // ... to here; count.by_name() for the breakdown
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace dtrain::testing {

class OpCounter {
 public:
  OpCounter() {
    state().depth = 0;
    state().counts.clear();
    handle_ =
        at::addThreadLocalCallback(at::RecordFunctionCallback(&OpCounter::enter, &OpCounter::leave)
                                       .scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounter() { at::removeCallback(handle_); }
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;

  int64_t total() const {
    int64_t n = 0;
    for (const auto& [name, c] : state().counts) n += c;
    return n;
  }
  const std::map<std::string, int64_t>& by_name() const { return state().counts; }

 private:
  struct State {
    int depth = 0;
    std::map<std::string, int64_t> counts;
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    if (state().depth++ == 0) ++state().counts[fn.name()];
    return nullptr;
  }
  static void leave(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {
    --state().depth;
  }

  at::CallbackHandle handle_;
};

}  // namespace dtrain::testing

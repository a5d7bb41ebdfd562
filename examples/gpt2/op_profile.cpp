#include "op_profile.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "metrics.h"

namespace gpt2 {
namespace {

using Clock = std::chrono::steady_clock;

struct Frame {
  Clock::time_point start;
  double children_s = 0;  // inclusive time of the events that ended inside this one
};

// What the observer callbacks of this thread need: the target (null: not recording on this
// thread) and the events open on this thread.
struct ThreadState {
  OpProfile* target = nullptr;
  std::vector<Frame> open;
};
thread_local ThreadState t_state;

// One OpRecorder, hence one registered callback, per process (see op_profile.h).
std::atomic<bool> g_recording{false};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& /*fn*/) {
  ThreadState& t = t_state;
  if (t.target != nullptr) t.open.push_back({Clock::now(), 0.0});
  return nullptr;  // the frame lives on the thread's stack, no allocation per event
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  ThreadState& t = t_state;
  // Empty: the event began before this recorder (its end still reaches us because an
  // event keeps the callbacks it started with).
  if (t.target == nullptr || t.open.empty()) return;
  const auto now = Clock::now();
  const Frame f = t.open.back();
  t.open.pop_back();
  const double total = std::chrono::duration<double>(now - f.start).count();
  if (!t.open.empty()) t.open.back().children_s += total;
  t.target->add_call(fn.name(), total - f.children_s, total);
}

}  // namespace

void OpProfile::add_step(double wall_s) {
  ++steps_;
  wall_s_ += wall_s;
}

void OpProfile::add_call(const char* name, double self_s, double total_s) {
  OpStats& s = ops_[name];
  ++s.calls;
  s.self_s += self_s;
  s.total_s += total_s;
}

std::vector<std::pair<std::string, OpStats>> OpProfile::sorted() const {
  std::vector<std::pair<std::string, OpStats>> out(ops_.begin(), ops_.end());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.second.self_s != b.second.self_s ? a.second.self_s > b.second.self_s
                                              : a.first < b.first;
  });
  return out;
}

void OpProfile::write_json(const std::string& path) const {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw dtrain::Error("cannot write profile file " + path);
  out << fmt::format("{{\"steps\": {}, \"wall_s\": {:.6g}, \"ops\": [", steps_, wall_s_);
  const auto ops = sorted();
  for (size_t i = 0; i < ops.size(); ++i) {
    JsonLine j;
    j.add("name", ops[i].first).add("calls", ops[i].second.calls);
    j.add("self_s", ops[i].second.self_s).add("total_s", ops[i].second.total_s);
    out << (i == 0 ? "\n  " : ",\n  ") << j.str();
  }
  out << "\n]}\n";
  out.flush();
  if (!out) throw dtrain::Error("writing profile file " + path + " failed");
}

OpRecorder::OpRecorder(OpProfile& into) {
  if (g_recording.exchange(true)) {
    throw dtrain::InvalidArgument("OpRecorder: another OpRecorder is already recording");
  }
  t_state.target = &into;
  t_state.open.clear();
  try {
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_start, &on_end)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  } catch (...) {
    t_state.target = nullptr;
    g_recording.store(false);
    throw;
  }
}

OpRecorder::~OpRecorder() {
  at::removeCallback(handle_);
  t_state.target = nullptr;
  t_state.open.clear();
  g_recording.store(false);
}

}  // namespace gpt2

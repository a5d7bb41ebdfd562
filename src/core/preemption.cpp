#include "dtrain/preemption.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include "comm/control_plane.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

// A signal handler can only reach process-wide state: the flag, and whether a StopSignal owns
// the handlers (at most one does).
volatile std::sig_atomic_t g_received = 0;
std::atomic<bool> g_installed{false};

void on_signal(int sig) { g_received = sig; }

}  // namespace

StopSignal::StopSignal(StopSignalOptions options) : options_(std::move(options)) {
  if (options_.every < 1) {
    throw InvalidArgument("StopSignal: every must be >= 1, got " + std::to_string(options_.every));
  }
  if (g_installed.exchange(true)) {
    throw InvalidArgument("StopSignal: another StopSignal is alive in this process");
  }
  g_received = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : options_.signals) {
    struct sigaction old {};
    if (sigaction(sig, &sa, &old) != 0) {
      for (size_t i = 0; i < previous_.size(); ++i) {
        sigaction(options_.signals[i], &previous_[i], nullptr);
      }
      g_installed = false;
      throw InvalidArgument("StopSignal: cannot handle signal " + std::to_string(sig));
    }
    previous_.push_back(old);
  }
}

StopSignal::~StopSignal() {
  for (size_t i = 0; i < previous_.size(); ++i) {
    sigaction(options_.signals[i], &previous_[i], nullptr);
  }
  g_installed = false;
}

int StopSignal::received() const { return static_cast<int>(g_received); }

int StopSignal::should_stop(Communicator& comm) {
  if (agreed_ != 0) return agreed_;
  if (++calls_ % options_.every != 0) return 0;
  const std::vector<int64_t> all =
      ControlPlane(comm).all_gather(std::vector<int64_t>{static_cast<int64_t>(received())});
  // The largest: every rank picks the same one when ranks received different signals.
  agreed_ = static_cast<int>(*std::max_element(all.begin(), all.end()));
  return agreed_;
}

}  // namespace dtrain

#include "stop_signal.h"

#include <signal.h>

#include <csignal>

namespace gpt2 {
namespace {

// A signal handler can only reach process-wide state: this is the one global of the trainer.
volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) { g_stop_signal = sig; }

}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

int stop_signal() { return static_cast<int>(g_stop_signal); }

}  // namespace gpt2

#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>

namespace {

// A crash in a test prints the native stack (to stderr, after gtest's "[ RUN ]" line), so a
// segfault on a machine no one can log into still names the frame. Default action afterwards.
void print_stack_and_reraise(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  constexpr char kHeader[] = "\n*** fatal signal; native stack:\n";
  (void)!write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install_crash_handler() {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now: the handler must not allocate
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) {
    std::signal(sig, print_stack_and_reraise);
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  install_crash_handler();
  return RUN_ALL_TESTS();
}

#include <dlfcn.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace {

void put(const char* s) { (void)!write(STDERR_FILENO, s, std::strlen(s)); }

void put_hex(uintptr_t v) {
  char buf[2 + 16 + 1];
  buf[0] = '0';
  buf[1] = 'x';
  for (int i = 0; i < 16; ++i) buf[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 0xf];
  buf[18] = '\0';
  put(buf);
}

// "<address> <module>+<offset> (<symbol>)": enough to find the frame with addr2line.
void put_frame(const char* label, uintptr_t pc) {
  put(label);
  put_hex(pc);
  Dl_info info;
  if (pc != 0 && dladdr(reinterpret_cast<void*>(pc), &info) != 0) {
    put(" ");
    put(info.dli_fname != nullptr ? info.dli_fname : "?");
    put("+");
    put_hex(pc - reinterpret_cast<uintptr_t>(info.dli_fbase));
    if (info.dli_sname != nullptr) {
      put(" (");
      put(info.dli_sname);
      put(")");
    }
  }
  put("\n");
}

// A crash in a test prints where it happened (to stderr, after gtest's "[ RUN ]" line), so a
// segfault on a machine no one can log into still names its frame. The faulting instruction
// and, for a jump to a bad address, the caller (the return address on top of the stack) come
// from the signal's context, since the unwinder cannot step out of an address without code.
void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  put("\n*** fatal signal ");
  put(strsignal(sig));
  put("; fault address ");
  put_hex(reinterpret_cast<uintptr_t>(info->si_addr));
  put("\n");
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  const auto pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  const auto sp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
  put_frame("  instruction ", pc);
  put_frame("  return address at the stack top ", *reinterpret_cast<const uintptr_t*>(sp));
#else
  (void)context;
#endif
  void* frames[64];
  const int n = backtrace(frames, 64);
  put("  native stack:\n");
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_crash_handler() {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now: the handler must not allocate
  struct sigaction action {};
  action.sa_sigaction = on_fatal_signal;
  action.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) sigaction(sig, &action, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  install_crash_handler();
  return RUN_ALL_TESTS();
}

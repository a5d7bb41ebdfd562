// Intercepting LibTorch warnings (TORCH_WARN) on this thread: LibTorch 2.x changed the
// handler's interface (one c10::Warning argument instead of location, message and flag, and
// moved the guard to c10::WarningUtils), so the difference lives here. Tests use it to check
// dtrain's warnings; a program can copy the idea to route them to its own log.
#pragma once

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <string>
#include <vector>

namespace dtrain::compat {

// Collects the messages of the warnings issued while it lives (instead of printing them).
// c10's handler is per thread: warnings of other threads are not collected.
class WarningCapture : public c10::WarningHandler {
 public:
  WarningCapture() : previous_(get()) { set(this); }
  ~WarningCapture() override { set(previous_); }
  WarningCapture(const WarningCapture&) = delete;
  WarningCapture& operator=(const WarningCapture&) = delete;

  const std::vector<std::string>& messages() const { return messages_; }

#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& warning) override { messages_.push_back(warning.msg()); }

 private:
  static c10::WarningHandler* get() { return c10::WarningUtils::get_warning_handler(); }
  static void set(c10::WarningHandler* h) { c10::WarningUtils::set_warning_handler(h); }
#else
  void process(const c10::SourceLocation& /*where*/, const std::string& msg,
               bool /*verbatim*/) override {
    messages_.push_back(msg);
  }

 private:
  static c10::WarningHandler* get() { return c10::Warning::get_warning_handler(); }
  static void set(c10::WarningHandler* h) { c10::Warning::set_warning_handler(h); }
#endif

  c10::WarningHandler* previous_;
  std::vector<std::string> messages_;
};

}  // namespace dtrain::compat

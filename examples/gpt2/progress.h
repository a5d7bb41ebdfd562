// Progress display of the GPT-2 trainer: a redrawn bar with ETA, loss and throughput when
// stdout is a terminal, plain log lines otherwise (logs, CI, pipes).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace gpt2 {

struct StepReport {
  int64_t step = 0;   // 1-based, over the whole run
  int64_t epoch = 0;  // 1-based
  double loss = 0;
  double grad_norm = 0;
  double lr = 0;
  double tokens_per_s = 0;
  double step_time_s = 0;
};

class Progress {
 public:
  // total_steps: steps of the whole run; log_every: steps between plain log lines.
  Progress(int64_t total_steps, int64_t epochs, int64_t log_every, bool terminal);

  void step(const StepReport& r);
  // A line that must stay visible (epoch summary, validation): clears the bar first.
  void line(const std::string& text);

  bool terminal() const { return terminal_; }

 private:
  std::string eta(int64_t step) const;
  void clear_bar();

  int64_t total_steps_, epochs_, log_every_;
  bool terminal_;
  bool bar_shown_ = false;
  std::chrono::steady_clock::time_point start_;
  double smoothed_tokens_per_s_ = 0;
};

// Whether stdout is a terminal.
bool stdout_is_terminal();

// "1h02m", "3m07s", "12s".
std::string format_duration(double seconds);

}  // namespace gpt2

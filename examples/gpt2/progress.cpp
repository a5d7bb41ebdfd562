#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

namespace gpt2 {

bool stdout_is_terminal() { return isatty(STDOUT_FILENO) == 1; }

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto total = static_cast<int64_t>(std::lround(s));
  if (total >= 3600) return fmt::format("{}h{:02}m", total / 3600, total % 3600 / 60);
  if (total >= 60) return fmt::format("{}m{:02}s", total / 60, total % 60);
  return fmt::format("{}s", total);
}

Progress::Progress(int64_t total_steps, int64_t epochs, int64_t log_every, bool terminal)
    : total_steps_(std::max<int64_t>(total_steps, 1)),
      epochs_(epochs),
      log_every_(std::max<int64_t>(log_every, 1)),
      terminal_(terminal),
      start_(std::chrono::steady_clock::now()) {}

std::string Progress::eta(int64_t step) const {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  return format_duration(elapsed / static_cast<double>(step) *
                         static_cast<double>(total_steps_ - step));
}

void Progress::clear_bar() {
  if (bar_shown_) {
    std::fputs("\r\033[K", stdout);
    bar_shown_ = false;
  }
}

void Progress::step(const StepReport& r) {
  // Exponential smoothing keeps the displayed throughput readable from step to step.
  smoothed_tokens_per_s_ = smoothed_tokens_per_s_ == 0
                               ? r.tokens_per_s
                               : 0.8 * smoothed_tokens_per_s_ + 0.2 * r.tokens_per_s;
  if (terminal_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * r.step / total_steps_);
    fmt::print("\r\033[K[{}{}] {}/{} ep {}/{} loss {:.4f} {:.0f} tok/s ETA {}",
               std::string(filled, '#'), std::string(kWidth - filled, '.'), r.step, total_steps_,
               r.epoch, epochs_, r.loss, smoothed_tokens_per_s_, eta(r.step));
    std::fflush(stdout);
    bar_shown_ = true;
    return;
  }
  if (r.step % log_every_ == 0 || r.step == total_steps_ || r.step == 1) {
    fmt::print(
        "step {}/{} epoch {}/{} loss {:.4f} grad_norm {:.3f} lr {:.3g} {:.0f} tok/s "
        "{:.3f} s/step ETA {}\n",
        r.step, total_steps_, r.epoch, epochs_, r.loss, r.grad_norm, r.lr, r.tokens_per_s,
        r.step_time_s, eta(r.step));
    std::fflush(stdout);
  }
}

void Progress::line(const std::string& text) {
  clear_bar();
  fmt::print("{}\n", text);
  std::fflush(stdout);
}

}  // namespace gpt2

#include "strategy/step_failure.h"

#include <fmt/format.h>

namespace dtrain {

std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

std::exception_ptr StepFailure::break_with(const char* op, int64_t step, const std::string& why,
                                           std::exception_ptr cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!broken_) {
    if (!cause) cause = out_of_step_cause_;
    broken_ = std::make_exception_ptr(
        CommError(ErrorContext{rank_, world_size_, op, -1},
                  fmt::format("{} is unusable since step {}: {}: {}", strategy_, step, why,
                              cause ? describe(cause) : std::string("no cause"))));
    state_ = State::kBroken;
  }
  return broken_;
}

}  // namespace dtrain

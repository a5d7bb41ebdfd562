#include "comm/failure.h"

#include <fmt/format.h>

#include <string>

namespace dtrain::detail {
namespace {

std::string first_line(std::string msg) {
  if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  return msg;
}

}  // namespace

std::exception_ptr as_comm_error(const ErrorContext& ctx, std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const DesyncError& e) {
    return std::make_exception_ptr(DesyncError(ctx, e.cause()));
  } catch (const TimeoutError& e) {
    return std::make_exception_ptr(TimeoutError(ctx, e.cause()));
  } catch (const Error& e) {
    return std::make_exception_ptr(CommError(ctx, e.cause()));
  } catch (const std::exception& e) {
    // Never classified by its text: engines turn their library's timeouts into TimeoutError
    // where they know a wait ran out (gloo/bounded_wait.h).
    return std::make_exception_ptr(CommError(ctx, first_line(e.what())));
  } catch (...) {
    return std::make_exception_ptr(CommError(ctx, "unknown exception (not a std::exception)"));
  }
}

std::exception_ptr after_failure(const ErrorContext& ctx, const std::exception_ptr& first,
                                 const char* what) {
  try {
    std::rethrow_exception(first);
  } catch (const Error& e) {
    const ErrorContext& at = e.context();
    const std::string where = at.sequence >= 0 ? fmt::format("{} #{}", at.op, at.sequence) : at.op;
    return std::make_exception_ptr(
        CommError(ctx, fmt::format("{}, at {}: {}", what, where, e.cause())));
  } catch (const std::exception& e) {
    return std::make_exception_ptr(CommError(ctx, fmt::format("{}: {}", what, e.what())));
  } catch (...) {
    return std::make_exception_ptr(CommError(ctx, what));
  }
}

std::exception_ptr StickyFailure::first() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_;
}

void StickyFailure::record(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!first_) first_ = std::move(error);
}

std::exception_ptr StickyFailure::check(const ErrorContext& ctx) const {
  std::exception_ptr first = this->first();
  return first ? after_failure(ctx, first) : nullptr;
}

std::exception_ptr StickyFailure::run(const ErrorContext& ctx,
                                      const std::function<void()>& body) noexcept {
  try {
    if (auto earlier = check(ctx)) return earlier;
    body();
    return nullptr;
  } catch (...) {
    std::exception_ptr error;
    try {
      error = as_comm_error(ctx, std::current_exception());
    } catch (...) {  // out of memory while formatting: keep what was thrown
      error = std::current_exception();
    }
    record(error);
    return error;
  }
}

}  // namespace dtrain::detail

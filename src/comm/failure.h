// What every backend does with a failure: turn whatever was thrown into a dtrain error naming
// the call, and remember the first one (errors are sticky on a communicator).
#pragma once

#include <exception>
#include <functional>
#include <mutex>

#include "dtrain/errors.h"

namespace dtrain::detail {

// `error` as a dtrain error with context `ctx`: DesyncError, TimeoutError and CommError keep
// their kind, any other dtrain error becomes a CommError, and so does any other exception
// (a std::exception keeps the first line of its message: Gloo appends stack traces; anything
// else says it was not a std::exception). A foreign exception is never classified by its
// text: an engine that knows a wait ran out throws TimeoutError itself
// (gloo/bounded_wait.h).
std::exception_ptr as_comm_error(const ErrorContext& ctx, std::exception_ptr error);

// The CommError of a call that cannot run because of `first`, an earlier failure:
// "<what>, at all_reduce #17: <its cause>".
std::exception_ptr after_failure(const ErrorContext& ctx, const std::exception_ptr& first,
                                 const char* what = "communicator failed earlier");

// The first failure of a communicator. Thread-safe.
class StickyFailure {
 public:
  // The first failure recorded, or nullptr.
  std::exception_ptr first() const;
  // Records `error` unless a failure is already recorded.
  void record(std::exception_ptr error);
  // If broken: the error a call `ctx` fails with (after_failure); else nullptr.
  std::exception_ptr check(const ErrorContext& ctx) const;
  // Runs body unless broken. Whatever body throws becomes as_comm_error(ctx, ...), is
  // recorded and returned; nullptr on success. Never throws.
  std::exception_ptr run(const ErrorContext& ctx, const std::function<void()>& body) noexcept;

 private:
  mutable std::mutex mu_;
  std::exception_ptr first_;
};

}  // namespace dtrain::detail

// Work: the handle of an asynchronous communication call.
//
// Every Communicator call returns immediately with a Work. The tensors passed to the
// call are kept alive by the Work until it completes; the caller must not read an
// output, nor write an input, before wait() returns.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

namespace dtrain {

class Work {
 public:
  // Passed to wait() to use the communicator's configured timeout.
  static constexpr std::chrono::milliseconds kDefaultTimeout{-1};

  virtual ~Work() = default;

  // True once the call finished, successfully or not. Never blocks.
  virtual bool is_completed() const = 0;

  // Blocks until the call finished and rethrows its failure, if any (a dtrain::Error).
  // Throws dtrain::TimeoutError if it is still running after `timeout`; the call itself
  // then keeps running and the communicator's own timeout ends it.
  // On CUDA backends wait() with the default timeout only orders the caller's stream after
  // the call and returns without blocking the host (see synchronize()); with an explicit
  // timeout, and for barrier(), it blocks the host until the call finished.
  virtual void wait(std::chrono::milliseconds timeout = kDefaultTimeout) = 0;

  // On CUDA backends: makes the caller's stream wait for the call without blocking the
  // host. On CPU backends: same as wait().
  virtual void synchronize() { wait(); }

  // The failure of a completed call, or nullptr.
  virtual std::exception_ptr exception() const = 0;

  // The communicator-wide sequence number of this call (identical on every rank for
  // the same call) and its name ("all_reduce", ...).
  virtual uint64_t sequence_number() const = 0;
  virtual const std::string& op_name() const = 0;
};

using WorkPtr = std::shared_ptr<Work>;

// A Work that completes when `work` completes and `continuation` has run. The continuation
// runs once, after the inner work succeeded, on the first thread that calls wait() (or
// synchronize()); its exception becomes the Work's failure. is_completed() and exception()
// never run it and never wait for a thread running it: the Work completes when the
// continuation has run, or as soon as the inner work failed (the continuation then never
// runs). So a successful one must be waited for; polling alone never completes it. Throws
// InvalidArgument if `work` is null.
WorkPtr then(WorkPtr work, std::function<void()> continuation);

}  // namespace dtrain

// Telling Gloo's timeouts from its other failures by state, not by message text. Gloo
// reports both as gloo::IoException; what dtrain knows itself is how long it let the wait
// run. Every Gloo wait gets a timeout and starts after `start`, so an IoException thrown
// once `timeout` has elapsed since `start` is that wait running out; one thrown earlier is a
// transport failure (a peer closed its connection, a write failed), even where Gloo's text
// mentions a timeout (a pair failed by another wait's timeout).
#pragma once

#include <gloo/common/error.h>

#include <chrono>
#include <string>

#include "dtrain/errors.h"

namespace dtrain::gloo_backend {

using WaitClock = std::chrono::steady_clock;

// The first line of a foreign message (Gloo appends stack traces).
inline std::string first_line(const std::string& msg) { return msg.substr(0, msg.find('\n')); }

// Runs `body`, whose Gloo waits are bounded by `timeout` and start no earlier than now. A
// gloo::IoException becomes `on_timeout(first line of Gloo's message)` (a TimeoutError)
// when the wait ran out, CommError (Gloo's message) otherwise.
template <typename Body, typename OnTimeout>
void bounded_wait(std::chrono::milliseconds timeout, Body&& body, OnTimeout&& on_timeout) {
  const auto start = WaitClock::now();
  try {
    body();
  } catch (const gloo::IoException& e) {
    const std::string what = first_line(e.what());
    if (WaitClock::now() - start >= timeout) throw on_timeout(what);
    throw CommError(what);
  }
}

// The same, a timeout reported as TimeoutError with Gloo's message.
template <typename Body>
void bounded_wait(std::chrono::milliseconds timeout, Body&& body) {
  bounded_wait(timeout, std::forward<Body>(body),
               [](const std::string& what) { return TimeoutError(what); });
}

}  // namespace dtrain::gloo_backend

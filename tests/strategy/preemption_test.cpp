// dtrain::StopSignal: a SIGTERM stops every rank at the same step.
#include <gtest/gtest.h>

#include <signal.h>

#include <csignal>
#include <cstdint>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/preemption.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// Rank 0 is signalled before its call `signal_at`; each rank returns the call at which
// should_stop() said stop. Ranks are threads: rank 1 reads the process's flag whenever its
// thread gets there, before or after rank 0 raised it, so only the agreement makes the
// calls equal.
std::vector<int64_t> stop_calls(int64_t every, int64_t signal_at) {
  StopSignalOptions o;
  o.every = every;
  StopSignal stop(o);
  std::vector<int64_t> calls(2, -1);
  std::vector<int> signals(2, 0);
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    for (int64_t call = 1; call <= 100; ++call) {
      if (r == 0 && call == signal_at) std::raise(SIGTERM);
      if (const int sig = stop.should_stop(comm)) {
        calls[static_cast<size_t>(r)] = call;
        signals[static_cast<size_t>(r)] = sig;
        break;
      }
    }
  });
  DTRAIN_CHECK(signals[0] == SIGTERM && signals[1] == SIGTERM, "signals {} {}", signals[0],
               signals[1]);
  return calls;
}

TEST(StopSignal, EveryRankStopsAtTheSameCall) {
  const auto calls = stop_calls(/*every=*/1, /*signal_at=*/5);
  EXPECT_EQ(calls[0], 5);  // rank 0 had its flag before the call
  EXPECT_EQ(calls[1], 5);
}

TEST(StopSignal, AgreesOnEveryNthCallOnly) {
  const auto calls = stop_calls(/*every=*/4, /*signal_at=*/5);
  EXPECT_EQ(calls[0], 8);
  EXPECT_EQ(calls[1], 8);
}

TEST(StopSignal, RestoresTheHandlersAndAllowsOneAtATime) {
  struct sigaction before {};
  sigaction(SIGTERM, nullptr, &before);
  {
    StopSignal stop;
    EXPECT_THROW(StopSignal second, InvalidArgument);
    EXPECT_EQ(stop.received(), 0);
    std::raise(SIGINT);
    EXPECT_EQ(stop.received(), SIGINT);  // the process goes on
  }
  struct sigaction after {};
  sigaction(SIGTERM, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
  {
    StopSignal fresh;  // the flag starts clear
    EXPECT_EQ(fresh.received(), 0);
  }
  StopSignalOptions bad;
  bad.every = 0;
  EXPECT_THROW(StopSignal{bad}, InvalidArgument);
  StopSignal after_failure;  // a refused one leaves nothing installed
}

}  // namespace
}  // namespace dtrain

// Stopping every rank at the same step when the job is asked to stop: a scheduler's SIGTERM
// before preemption, or Ctrl-C (SIGINT).
//
// clang-format off
//   dtrain::StopSignal stop;  // SIGTERM and SIGINT now set a flag instead of killing
//   for (int64_t step = start; step < steps; ++step) {
//     train_step(step);                               // forward, backward, optimizer step
//     if (const int sig = stop.should_stop(*comm)) {  // collective: every rank, every step
//       state.step = step + 1;                        // optimizer steps taken
//       checkpointer.save(*strategy, &opt, state);    // the same step on every rank
//       break;                                        // or exit with 128 + sig
//     }
//   }
//   strategy->finish();
// clang-format on
//
// Signals reach ranks at different moments (the launcher forwards one to each rank, a
// scheduler signals each host), so each rank's own flag would stop the ranks at different
// steps, and the ones still stepping would wait in a collective for the ones that left.
// should_stop() agrees: one all-gather of one int64 per rank over the communicator, and every
// rank gets the same answer at the same call. StopSignalOptions::every = N agrees on every
// N-th call only (the others return 0 at once, no communication); a stop then lands on a
// call whose number is a multiple of N, up to N - 1 steps after the signal.
//
// A trainer that all-gathers per-step values anyway can carry received() in them instead and
// stop when any rank's value is non-zero (gpt2_train does), with no collective of its own.
//
// A signal handler can reach only process-wide state, so one StopSignal may be alive at a time
// (a second one throws InvalidArgument); destroying it restores the previous handlers.
#pragma once

#include <signal.h>

#include <csignal>
#include <cstdint>
#include <vector>

#include "dtrain/communicator.h"

namespace dtrain {

struct StopSignalOptions {
  // The signals that ask to stop; the default handlers of the others stay.
  std::vector<int> signals = {SIGTERM, SIGINT};
  // should_stop() communicates on every `every`-th call (>= 1; InvalidArgument otherwise).
  int64_t every = 1;
};

class StopSignal {
 public:
  // Installs the handlers (a flag is set; the process goes on).
  explicit StopSignal(StopSignalOptions options = {});
  ~StopSignal();  // restores the handlers that were installed before
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  // The last of the signals this process received since construction (0: none). Local: no
  // communication, safe to call anywhere.
  int received() const;

  // Collective over `comm` (every rank, at the same point of each step, e.g. after the
  // optimizer step; between steps, never inside forward/backward): the signal some rank
  // received, the same value on every rank, or 0. Once non-zero it stays so, with no more
  // communication. Throws what the all-gather throws (a peer gone: its CommError).
  int should_stop(Communicator& comm);

 private:
  StopSignalOptions options_;
  std::vector<struct sigaction> previous_;
  int64_t calls_ = 0;
  int agreed_ = 0;
};

}  // namespace dtrain

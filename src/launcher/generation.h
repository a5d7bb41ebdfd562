// One generation of this node's ranks: start them, supervise them until every one has
// ended. Shared by run_node (dtrain/launcher.h: one node, restarts) and the elastic agent
// (launcher/elastic.h: a generation's place in the job comes from the rendezvous).
#pragma once

#include <signal.h>

#include <functional>
#include <map>
#include <string>

#include "dtrain/launcher.h"

namespace dtrain::launcher {

// Installs the launcher's handler for SIGINT, SIGTERM, SIGHUP and SIGQUIT while alive and
// restores the old handlers after. A SIGHUP ignored on entry (nohup) stays ignored. SIGCHLD
// is at its default meanwhile: ignored, the kernel would reap the ranks and lose their
// statuses. One at a time per process (the handler records into static storage).
class SignalForwarding {
 public:
  SignalForwarding();
  ~SignalForwarding();
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  struct sigaction old_[4]{};
  struct sigaction old_chld_ {};
};

// The stop signal received and not yet handled by a generation, 0 if none.
int pending_stop_signal();

const char* signal_name(int sig);

// Where this node's ranks stand in one generation.
struct GenerationSpec {
  int generation = 0;     // DTRAIN_GENERATION
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT
  int first_rank = 0;     // RANK of local rank 0
  int world_size = 1;     // WORLD_SIZE
  std::string master_addr;
  int master_port = 0;
  // Added to the ranks' environment after NodeOptions::environment (e.g. the generation's
  // DTRAIN_STORE_TOKEN).
  std::map<std::string, std::string> environment;
};

// How one generation of this node's ranks ended.
struct GenerationOutcome {
  int result = 0;        // the exit status if nothing follows
  int received = 0;      // the stop signal the launcher received, 0 if none
  bool failed = false;   // a rank failed (or could not be waited for) before any signal or stop
  bool stopped = false;  // stop_requested() said so before any rank failed
  std::string failure;   // which rank failed and how, when failed
};

// Starts this node's ranks as `spec` says and supervises them until every one has ended
// (the failure model in dtrain/launcher.h). `stop_requested`, when set, is called about
// every 20 ms while every rank runs; once it returns true the ranks are stopped as for a
// failure (SIGTERM, their trees SIGKILLed after NodeOptions::grace). Throws
// std::runtime_error when a rank cannot be started (those already started are killed).
GenerationOutcome run_generation(const NodeOptions& options, const std::string& supervisor,
                                 const GenerationSpec& spec, bool null_stdin,
                                 const std::function<bool()>& stop_requested = {});

}  // namespace dtrain::launcher

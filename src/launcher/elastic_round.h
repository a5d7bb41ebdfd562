// The rendezvous rounds of the elastic agent (the protocol is in launcher/elastic.h).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/store.h"
#include "launcher/elastic.h"

namespace dtrain::launcher::elastic {

// One agent of a round.
struct AgentInfo {
  int slot = 0;  // its place in the order of joining, from 1
  std::string host;
  int nproc = 1;
};

// A closed round that this agent is a member of.
struct Membership {
  int round = 0;
  int restarts = 0;  // failure restarts before this generation (TORCHELASTIC_RESTART_COUNT)
  std::vector<AgentInfo> members;  // in rank order
  size_t me = 0;                   // this agent's index in members
};

// How a rendezvous ended when it did not make this agent a member.
struct RendezvousEnd {
  enum class Kind { kJobDone, kJobFailed, kLeftOut, kSignal } kind = Kind::kJobDone;
  std::string message;
  int signal = 0;
};

// The store keys of round/generation `round`.
std::string key(int round, const std::string& what);

// True when key is set in the store (never blocks).
bool is_set(Store& store, const std::string& key);

// The integer at key (0 when absent), without changing it.
int64_t counter(Store& store, const std::string& key);

// The failure count of host `host`.
int64_t host_failures(Store& store, const std::string& host);

// Ends generation `round` for every member, once: the first agent to call it says why.
// kind "rank" (a rank of `host` failed: a restart, counted against --max_restarts), "lost"
// (an agent's heartbeat stopped), "join" (an agent asks to join), "signal".
void end_generation(Store& store, const ElasticOptions& o, int round, const std::string& kind,
                    const std::string& host, const std::string& reason);

// Joins round `round`, or the first later one that is still open, and waits until it closes
// (closing it when this agent is the first to see the rule met). Returns the membership, or
// why the job has no place for this agent. Throws std::runtime_error when no round closes
// within join_timeout, and the store's errors.
class Rendezvous {
 public:
  Rendezvous(const ElasticOptions& options, std::shared_ptr<Store> store)
      : o_(options), store_(std::move(store)) {}

  // Exactly one of the two is set.
  struct Result {
    std::optional<Membership> membership;
    std::optional<RendezvousEnd> end;
  };
  Result join(int round);

 private:
  using Clock = std::chrono::steady_clock;

  // Closes `round` if the rule is met now and this agent wins the election.
  void try_close(int round, int64_t joined);
  // Watches the heartbeats of running generation `previous` while this agent waits for it
  // to end; ends it when none of its members' heartbeats moved for heartbeat_timeout (every
  // agent of it is gone: e.g. a whole attempt killed and the job started again with the same
  // id on etcd), which nobody else would.
  void watch_running(int previous, Clock::time_point now);
  // Counts the failures of generation `previous` against hosts, once per generation.
  void count_failures(int previous, const std::vector<AgentInfo>& joined);
  std::vector<AgentInfo> read_agents(int round, int64_t count);
  std::optional<Membership> read_membership(int round, int slot);

  const ElasticOptions& o_;
  std::shared_ptr<Store> store_;
  // watch_running's view: per member slot of the watched generation, its heartbeat count
  // and when it last moved.
  int watched_ = -1;
  std::map<int, std::pair<int64_t, Clock::time_point>> beats_;
};

// Parses the "N/agent/S" value; throws std::runtime_error when malformed.
AgentInfo parse_agent(int slot, const std::string& value);

}  // namespace dtrain::launcher::elastic

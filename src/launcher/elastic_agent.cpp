// run_elastic: the agent's life, rendezvous -> generation -> rendezvous ... (launcher/elastic.h).
#include <unistd.h>

#include <map>
#include <optional>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "launcher/elastic.h"
#include "launcher/elastic_round.h"
#include "launcher/generation.h"
#include "launcher/spawn.h"
#include "launcher/supervisor.h"

namespace dtrain::launcher {
namespace {

using Clock = std::chrono::steady_clock;
using elastic::counter;
using elastic::is_set;
using elastic::key;

constexpr std::chrono::milliseconds kMonitorEvery{100};
constexpr std::chrono::milliseconds kMasterTimeout{30000};

long seconds(std::chrono::milliseconds d) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::seconds>(d).count());
}

class Agent {
 public:
  Agent(const ElasticOptions& o, std::shared_ptr<Store> store)
      : o_(o), store_(std::move(store)), supervisor_(find_supervisor(o.node.supervisor)) {}

  int run() {
    const bool null_stdin = isatty(0) == 1;
    int round = static_cast<int>(counter(*store_, "round"));
    for (;;) {
      elastic::Rendezvous rdzv(o_, store_);
      const elastic::Rendezvous::Result r = rdzv.join(round);
      if (r.end) return ended(*r.end);
      const elastic::Membership& m = *r.membership;
      const GenerationOutcome g = run_generation_of(m, null_stdin);
      if (const int rc = after(m, g); rc >= 0) return rc;
      round = std::max(m.round + 1, static_cast<int>(counter(*store_, "round")));
    }
  }

 private:
  int ended(const elastic::RendezvousEnd& e) {
    using Kind = elastic::RendezvousEnd::Kind;
    switch (e.kind) {
      case Kind::kJobDone:
        fmt::print(stderr, "{}: {}\n", o_.node.name, e.message);
        return 0;
      case Kind::kSignal:
        fmt::print(stderr, "{}: {} received while waiting for a generation\n", o_.node.name,
                   signal_name(e.signal));
        return 128 + e.signal;
      case Kind::kJobFailed:
      case Kind::kLeftOut:
        fmt::print(stderr, "{}: {}\n", o_.node.name, e.message);
        return 1;
    }
    return 1;
  }

  void end_generation(int round, const std::string& kind, const std::string& host,
                      const std::string& reason) {
    elastic::end_generation(*store_, o_, round, kind, host, reason);
  }

  // The first member picks the address where its rank 0 serves the ranks' store; every
  // member reads it (bounded by kMasterTimeout).
  void publish_and_read_master(const elastic::Membership& m, GenerationSpec& spec) {
    if (m.me == 0) {
      std::string addr = store_->network_address();
      if (addr.empty()) addr = "127.0.0.1";
      store_->set(key(m.round, "master"), fmt::format("{}:{}", addr, free_port()));
    }
    const std::string master = store_->get_string(key(m.round, "master"), kMasterTimeout);
    const size_t colon = master.rfind(':');
    spec.master_addr = master.substr(0, colon);
    spec.master_port = std::stoi(master.substr(colon + 1));
  }

  GenerationOutcome run_generation_of(const elastic::Membership& m, bool null_stdin) {
    GenerationSpec spec;
    spec.generation = m.round;
    spec.restart_count = m.restarts;
    spec.world_size = 0;
    for (size_t i = 0; i < m.members.size(); ++i) {
      if (i == m.me) spec.first_rank = spec.world_size;
      spec.world_size += m.members[i].nproc;
    }
    const elastic::AgentInfo& me = m.members[m.me];
    try {
      if (o_.ranks_on_etcd) {
        spec.master_addr = o_.node.master_addr;
        spec.master_port = o_.node.master_port;
      } else {
        publish_and_read_master(m, spec);
      }
    } catch (const std::exception& e) {
      GenerationOutcome lost;
      lost.stopped = true;
      end_generation(m.round, "lost", m.members[0].host,
                     fmt::format("the ranks' store address of generation {} was not published "
                                 "by host {}: {}",
                                 m.round, m.members[0].host, e.what()));
      return lost;
    }
    spec.environment["DTRAIN_STORE_TOKEN"] = fmt::format("{}/generation/{}", o_.token, m.round);
    fmt::print(stderr,
               "{}: generation {}: host {} runs ranks {}..{} of {} ({} agent(s), restart {} of "
               "{}); store {}\n",
               o_.node.name, m.round, me.host, spec.first_rank, spec.first_rank + me.nproc - 1,
               spec.world_size, m.members.size(), m.restarts, o_.node.max_restarts,
               o_.ranks_on_etcd ? fmt::format("etcd /dtrain/<id>/{}/", m.round)
                                : fmt::format("{}:{}", spec.master_addr, spec.master_port));

    // Heartbeats: this agent's counter goes up every interval; a peer's that has not moved
    // for heartbeat_timeout means its agent is gone (or cut off).
    std::map<int, std::pair<int64_t, Clock::time_point>> peers;
    const auto start = Clock::now();
    for (size_t i = 0; i < m.members.size(); ++i) {
      if (i != m.me) peers[m.members[i].slot] = {-1, start};
    }
    auto last_beat = start - o_.heartbeat_interval;
    auto last_check = start;
    store_lost_ = false;
    // etcd: a call that failed (an add whose answer was lost on the way) is tried again at
    // the next check; only failures for heartbeat_timeout in a row lose the store. Not inside
    // end_generation: its steps are not idempotent, and a half-ended generation is not retried.
    std::optional<Clock::time_point> failing_since;
    bool ending = false;
    auto stop_requested = [&]() -> bool {
      const auto now = Clock::now();
      if (store_lost_ || now - last_check < kMonitorEvery) return false;
      last_check = now;
      try {
        if (now - last_beat >= o_.heartbeat_interval) {
          store_->add(key(m.round, fmt::format("hb/{}", me.slot)), 1);
          last_beat = now;
          for (auto& [slot, seen] : peers) {
            const int64_t v = counter(*store_, key(m.round, fmt::format("hb/{}", slot)));
            if (v != seen.first) {
              seen = {v, now};
            } else if (now - seen.second >= o_.heartbeat_timeout) {
              std::string host = "?";
              for (const auto& a : m.members) {
                if (a.slot == slot) host = a.host;
              }
              ending = true;
              end_generation(m.round, "lost", host,
                             fmt::format("no heartbeat from the agent of host {} for {} s", host,
                                         seconds(o_.heartbeat_timeout)));
              return true;
            }
          }
        }
        if (is_set(*store_, key(m.round, "ended"))) return true;
        if (static_cast<int>(m.members.size()) < o_.max_nodes &&
            counter(*store_, key(m.round + 1, "join")) > 0) {
          ending = true;
          end_generation(m.round, "join", "", "an agent asks to join");
          return true;
        }
        failing_since.reset();
      } catch (const std::exception& e) {
        if (o_.ranks_on_etcd && !ending) {
          if (!failing_since) {
            failing_since = now;
            fmt::print(stderr, "{}: a call to etcd failed ({}); trying again for up to {} s\n",
                       o_.node.name, e.what(), seconds(o_.heartbeat_timeout));
          }
          if (now - *failing_since < o_.heartbeat_timeout) return false;
        }
        fmt::print(stderr,
                   "{}: the rendezvous store is lost ({}); the ranks of generation {} go on, "
                   "but no generation can follow\n",
                   o_.node.name, e.what(), m.round);
        store_lost_ = true;
      }
      return false;
    };
    try {
      return run_generation(o_.node, supervisor_, spec, null_stdin, stop_requested);
    } catch (const std::exception& e) {  // a rank could not start
      GenerationOutcome failed;
      failed.failed = true;
      failed.result = 1;
      failed.failure = e.what();
      return failed;
    }
  }

  // What follows generation m: an exit status (>= 0), or -1 to join the next round.
  int after(const elastic::Membership& m, const GenerationOutcome& g) {
    const std::string& host = m.members[m.me].host;
    try {
      if (g.received != 0) {
        if (!store_lost_) {
          end_generation(
              m.round, "signal", host,
              fmt::format("the agent of host {} received {}", host, signal_name(g.received)));
        }
        fmt::print(stderr, "{}: ranks stopped after {}\n", o_.node.name, signal_name(g.received));
        return g.result;
      }
      if (!g.failed && !g.stopped) {
        if (store_lost_) return g.result;
        store_->add(key(m.round, "finished"), 1);
        store_->add("done", 1);
        if (o_.serves_store) wait_for_members(m);
        return g.result;
      }
      if (store_lost_) return g.failed ? g.result : 1;
      if (g.failed) {
        if (counter(*store_, "done") > 0) {
          fmt::print(stderr, "{}: {} after the job had finished on another host\n", o_.node.name,
                     g.failure);
          return g.result;
        }
        end_generation(m.round, "rank", host, fmt::format("host {}: {}", host, g.failure));
      }
      if (is_set(*store_, "failed")) {
        fmt::print(stderr, "{}: {}\n", o_.node.name,
                   store_->get_string("failed", std::chrono::seconds(5)));
        return g.failed ? g.result : 1;
      }
      if (const int sig = pending_stop_signal()) {
        fmt::print(stderr, "{}: {} received; not joining another generation\n", o_.node.name,
                   signal_name(sig));
        return 128 + sig;
      }
      return -1;
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: the rendezvous store is lost ({}); giving up\n", o_.node.name,
                 e.what());
      return g.failed || g.stopped ? (g.failed ? g.result : 1) : g.result;
    }
  }

  // The store lives in this agent: wait (bounded) until every member's ranks finished.
  void wait_for_members(const elastic::Membership& m) {
    const auto until = Clock::now() + o_.finish_wait;
    while (Clock::now() < until && pending_stop_signal() == 0 &&
           counter(*store_, key(m.round, "finished")) < static_cast<int64_t>(m.members.size()) &&
           !is_set(*store_, key(m.round, "ended"))) {
      std::this_thread::sleep_for(kMonitorEvery);
    }
  }

  const ElasticOptions& o_;
  std::shared_ptr<Store> store_;
  const std::string supervisor_;
  bool store_lost_ = false;
};

bool valid_host_id(const std::string& id) {
  if (id.empty() || id.size() > 255) return false;
  for (const char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '-' || c == '_' || c == ':';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

void validate(const ElasticOptions& o) {
  validate(o.node);
  if (o.min_nodes < 1 || o.max_nodes < o.min_nodes) {
    throw std::invalid_argument(
        fmt::format("--nnodes {}:{}: expected 1 <= MIN <= MAX", o.min_nodes, o.max_nodes));
  }
  if (!valid_host_id(o.host_id)) {
    throw std::invalid_argument(fmt::format(
        "host id '{}': expected 1 to 255 letters, digits, '.', '-', '_' or ':'", o.host_id));
  }
  if (o.max_host_failures < 1)
    throw std::invalid_argument("--max_host_failures must be at least 1");
  if (o.heartbeat_interval.count() <= 0 || o.heartbeat_timeout <= 2 * o.heartbeat_interval) {
    throw std::invalid_argument(
        "the heartbeat timeout must exceed twice the heartbeat interval (1 s)");
  }
  if (o.last_call.count() < 0)
    throw std::invalid_argument("--rdzv_last_call_s must not be negative");
  if (o.join_timeout.count() <= 0) throw std::invalid_argument("--rdzv_timeout_s must be positive");
  // The ranks' token is the job's plus "/generation/N"; the store takes 1024 bytes at most.
  if (o.token.size() > 1000) {
    throw std::invalid_argument("DTRAIN_STORE_TOKEN: at most 1000 bytes for an elastic job");
  }
}

int run_elastic(const ElasticOptions& options, std::shared_ptr<Store> store) {
  validate(options);
  SignalForwarding forwarding;
  Agent agent(options, std::move(store));
  return agent.run();
}

}  // namespace dtrain::launcher

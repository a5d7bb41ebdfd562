#include "launcher/elastic_round.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "launcher/generation.h"

namespace dtrain::launcher::elastic {
namespace {

constexpr std::chrono::milliseconds kPoll{100};
// Reading a key a live peer writes right after the add that announced it.
constexpr std::chrono::milliseconds kPeerKeyTimeout{5000};

}  // namespace

std::string key(int round, const std::string& what) { return fmt::format("{}/{}", round, what); }

bool is_set(Store& store, const std::string& k) { return store.check({k}); }

int64_t counter(Store& store, const std::string& k) { return store.add(k, 0); }

int64_t host_failures(Store& store, const std::string& host) {
  return counter(store, "host/" + host + "/failures");
}

void end_generation(Store& store, const ElasticOptions& o, int round, const std::string& kind,
                    const std::string& host, const std::string& reason) {
  if (store.add(key(round, "over"), 1) != 1) return;
  fmt::print(stderr, "{}: ending generation {}: {}\n", o.node.name, round, reason);
  if (kind == "rank" || kind == "lost") {
    const int64_t restarts = store.add("restarts", 1);
    if (restarts > o.node.max_restarts) {
      store.set("failed", fmt::format("generation {} failed ({}) and no restart is left "
                                      "(--max_restarts {}); giving up",
                                      round, reason, o.node.max_restarts));
    }
  }
  store.add("round", 1);
  store.set(key(round, "ended"), fmt::format("{}\n{}\n{}", kind, host, reason));
}

void Rendezvous::watch_running(int previous, Clock::time_point now) {
  if (watched_ != previous) {
    if (!is_set(*store_, key(previous, "members"))) return;
    std::istringstream m(store_->get_string(key(previous, "members"), kPeerKeyTimeout));
    int restarts = 0;
    m >> restarts;
    beats_.clear();
    for (int slot; m >> slot;) beats_[slot] = {-1, now};
    watched_ = previous;
  }
  bool moved = false;
  for (auto& [slot, seen] : beats_) {
    const int64_t v = counter(*store_, key(previous, fmt::format("hb/{}", slot)));
    if (v != seen.first) {
      seen = {v, now};
      moved = true;
    } else if (now - seen.second < o_.heartbeat_timeout) {
      moved = true;
    }
  }
  if (moved || beats_.empty()) return;
  end_generation(
      *store_, o_, previous, "lost", "",
      fmt::format("no heartbeat from any of its {} agent(s) for {} s", beats_.size(),
                  std::chrono::duration_cast<std::chrono::seconds>(o_.heartbeat_timeout).count()));
}

AgentInfo parse_agent(int slot, const std::string& value) {
  const size_t nl = value.find('\n');
  AgentInfo a;
  a.slot = slot;
  if (nl == std::string::npos || nl == 0) {
    throw std::runtime_error(fmt::format("malformed agent record of slot {}: '{}'", slot, value));
  }
  a.host = value.substr(0, nl);
  a.nproc = std::atoi(value.c_str() + nl + 1);
  if (a.nproc < 1) {
    throw std::runtime_error(fmt::format("malformed agent record of slot {}: '{}'", slot, value));
  }
  return a;
}

std::vector<AgentInfo> Rendezvous::read_agents(int round, int64_t count) {
  std::vector<AgentInfo> out;
  for (int s = 1; s <= count; ++s) {
    try {
      out.push_back(parse_agent(
          s, store_->get_string(key(round, fmt::format("agent/{}", s)), kPeerKeyTimeout)));
    } catch (const TimeoutError&) {
      // An agent that died between joining and describing itself: not a member.
    }
  }
  return out;
}

void Rendezvous::count_failures(int previous, const std::vector<AgentInfo>& joined) {
  const std::string members = store_->get_string(key(previous, "members"), kPeerKeyTimeout);
  const std::string ended = store_->get_string(key(previous, "ended"), kPeerKeyTimeout);
  std::istringstream m(members);
  int restarts = 0;
  m >> restarts;
  // "kind\nhost\nreason" (end_generation in elastic_agent.cpp).
  std::istringstream e(ended);
  std::string kind, host;
  std::getline(e, kind);
  std::getline(e, host);
  std::set<std::string> here;
  for (const auto& a : joined) here.insert(a.host);
  // An agent stopped by a signal (a scheduler's preemption, a person) left; it did not fail.
  if (kind == "signal") here.insert(host);
  bool lost = false;
  for (int slot; m >> slot;) {
    const AgentInfo a = parse_agent(
        slot, store_->get_string(key(previous, fmt::format("agent/{}", slot)), kPeerKeyTimeout));
    if (here.count(a.host) == 0) {
      const int64_t n = store_->add("host/" + a.host + "/failures", 1);
      fmt::print(stderr, "{}: host {} was lost from generation {} (failure {} of {})\n",
                 o_.node.name, a.host, previous, n, o_.max_host_failures);
      here.insert(a.host);  // one count per host, however many agents it ran
      lost = true;
    }
  }
  // A rank's failure is its host's only when nobody was lost: a lost host's death makes its
  // peers' ranks fail too.
  if (!lost && kind == "rank" && !host.empty()) {
    const int64_t n = store_->add("host/" + host + "/failures", 1);
    fmt::print(stderr, "{}: host {} failed generation {} (failure {} of {})\n", o_.node.name, host,
               previous, n, o_.max_host_failures);
  }
  store_->set(key(previous, "blame_done"), std::string("1"));
}

void Rendezvous::try_close(int round, int64_t joined) {
  const std::vector<AgentInfo> agents = read_agents(round, joined);
  if (round > 0) {
    if (store_->add(key(round - 1, "blame"), 1) == 1) count_failures(round - 1, agents);
    if (!is_set(*store_, key(round - 1, "blame_done"))) return;  // being counted: next poll
  }
  std::vector<AgentInfo> eligible;
  for (const auto& a : agents) {
    if (host_failures(*store_, a.host) < o_.max_host_failures) eligible.push_back(a);
  }
  if (static_cast<int>(eligible.size()) < o_.min_nodes) return;
  if (store_->add(key(round, "closed"), 1) != 1) return;  // another agent closes it
  if (static_cast<int>(eligible.size()) > o_.max_nodes) eligible.resize(o_.max_nodes);
  std::string value = std::to_string(counter(*store_, "restarts"));
  for (const auto& a : eligible) value += fmt::format(" {}", a.slot);
  store_->set(key(round, "members"), value);
}

std::optional<Membership> Rendezvous::read_membership(int round, int slot) {
  std::istringstream m(store_->get_string(key(round, "members"), kPeerKeyTimeout));
  Membership ms;
  ms.round = round;
  m >> ms.restarts;
  bool in = false;
  for (int s; m >> s;) {
    if (s == slot) {
      ms.me = ms.members.size();
      in = true;
    }
    ms.members.push_back(parse_agent(
        s, store_->get_string(key(round, fmt::format("agent/{}", s)), kPeerKeyTimeout)));
  }
  if (!in) return std::nullopt;
  return ms;
}

Rendezvous::Result Rendezvous::join(int round) {
  auto give_up = Clock::now() + o_.join_timeout;
  for (;;) {
    // Closed rounds are history (or running: joining the next one asks it to make room).
    while (is_set(*store_, key(round, "members"))) ++round;
    const int64_t slot = store_->add(key(round, "join"), 1);
    store_->set(key(round, fmt::format("agent/{}", slot)),
                fmt::format("{}\n{}", o_.host_id, o_.node.nproc_per_node));
    fmt::print(stderr, "{}: host {} joined round {} (slot {})\n", o_.node.name, o_.host_id, round,
               slot);
    bool previous_ended = round == 0;
    int64_t last_count = -1;
    auto last_change = Clock::now();
    for (;;) {
      if (const int sig = pending_stop_signal()) {
        return {std::nullopt, RendezvousEnd{RendezvousEnd::Kind::kSignal, "", sig}};
      }
      if (counter(*store_, "done") > 0) {
        return {std::nullopt, RendezvousEnd{RendezvousEnd::Kind::kJobDone,
                                            "the job finished before this agent was taken in"}};
      }
      if (is_set(*store_, "failed")) {
        return {std::nullopt, RendezvousEnd{RendezvousEnd::Kind::kJobFailed,
                                            store_->get_string("failed", kPeerKeyTimeout)}};
      }
      const int64_t failures = host_failures(*store_, o_.host_id);
      if (failures >= o_.max_host_failures) {
        return {std::nullopt,
                RendezvousEnd{RendezvousEnd::Kind::kLeftOut,
                              fmt::format("host {} failed {} times (--max_host_failures {}): left "
                                          "out of the job",
                                          o_.host_id, failures, o_.max_host_failures)}};
      }
      if (is_set(*store_, key(round, "members"))) {
        if (auto m = read_membership(round, static_cast<int>(slot))) return {std::move(m), {}};
        fmt::print(stderr, "{}: round {} closed without host {} (slot {}); joining round {}\n",
                   o_.node.name, round, o_.host_id, slot, round + 1);
        ++round;
        break;
      }
      const auto now = Clock::now();
      if (!previous_ended && is_set(*store_, key(round - 1, "ended"))) {
        previous_ended = true;
        last_change = now;  // the survivors of round - 1 get a whole last call
      }
      const int64_t count = counter(*store_, key(round, "join"));
      if (count != last_count) {
        last_count = count;
        last_change = now;
      }
      if (previous_ended && count >= o_.min_nodes &&
          (count >= o_.max_nodes || now - last_change >= o_.last_call)) {
        try_close(round, count);
        if (is_set(*store_, key(round, "members"))) continue;  // read the outcome at once
      }
      // A running generation may run for days: the join timeout counts from its end.
      if (!previous_ended) {
        give_up = now + o_.join_timeout;
        watch_running(round - 1, now);
      }
      if (now > give_up) {
        throw std::runtime_error(fmt::format(
            "rendezvous: round {} did not close within {} s ({} agent(s) joined, at least {} "
            "needed{})",
            round, std::chrono::duration_cast<std::chrono::seconds>(o_.join_timeout).count(), count,
            o_.min_nodes,
            previous_ended ? ""
                           : "; generation " + std::to_string(round - 1) + " is still running"));
      }
      std::this_thread::sleep_for(kPoll);
    }
  }
}

}  // namespace dtrain::launcher::elastic

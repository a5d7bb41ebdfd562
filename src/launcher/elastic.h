// The elastic agent of dtrain-run --nnodes MIN:MAX (docs/multinode.md, "Elastic runs"): one
// agent per host; the agents agree on numbered generations through a Store and run their
// ranks as the generation's part of the world.
//
// The round of generation N, in the store (every key under "dtrain-run/<rdzv_id>/"):
// - an agent joins by add("N/join", 1), which gives it slot s, and writes "N/agent/s" (its
//   host id and ranks);
// - the round may close once generation N-1 has ended ("N-1/ended" is set; round 0 at
//   once), and then when MAX agents joined, or when at least MIN (not left out) agents
//   joined and nobody joined for last_call (torchrun's last_call_timeout);
// - the first agent to add("N/closed", 1) closes it: it counts the failures of generation
//   N-1 against hosts (below), leaves out hosts that reached max_host_failures, and writes
//   "N/members": the restart count and the member slots, in rank order. An agent not among
//   them was too late (or left out) and joins round N+1, whose joining asks the running
//   generation to make room (if it has fewer than MAX agents);
// - the first member writes "N/master", where its rank 0 serves the ranks' store (not with
//   ranks_on_etcd: the ranks of generation N then meet in etcd under /dtrain/<id>/N/, and no
//   member hosts anything another needs).
// Generation N then runs until one agent ends it: add("N/over", 1) == 1 elects it, it sets
// "N/ended" with the reason (a rank failed, an agent's heartbeat "N/hb/s" stopped for
// heartbeat_timeout, a new agent asks to join, an agent was signalled), and advances
// "round". An agent waiting in round N+1 also watches generation N's heartbeats and ends it
// when none moved for heartbeat_timeout (all its agents are gone: nobody else would). Every member
// stops its ranks and joins round N+1. Keys carry the generation, so an agent of an old generation
// only ever reads that its generation ended.
//
// Failures per host ("host/<id>/failures"), counted when round N+1 closes: every member of
// generation N whose host did not join round N+1 (lost) gets one; when none was lost and N
// ended by a rank's failure, the host of that rank gets one.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "dtrain/launcher.h"
#include "dtrain/store.h"

namespace dtrain::launcher {

struct ElasticOptions {
  NodeOptions node;  // argv, nproc_per_node, grace, max_restarts, name, supervisor, environment
  int min_nodes = 1;
  int max_nodes = 1;
  // This agent's host in messages and failure counts; the hostname by default.
  std::string host_id;
  // The job's name: its keys in the store are under "dtrain-run/<rdzv_id>/" (the caller's
  // prefix store).
  std::string rdzv_id = "none";
  std::chrono::milliseconds last_call = std::chrono::seconds(5);
  std::chrono::milliseconds heartbeat_interval = std::chrono::seconds(1);
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(30);
  // How long a round may wait for MIN agents before this agent gives up.
  std::chrono::milliseconds join_timeout = std::chrono::seconds(600);
  // A host whose failure count reached this is left out of every later generation.
  int max_host_failures = 3;
  // The ranks' DTRAIN_STORE_TOKEN is this plus "/generation/N" (a rank of another
  // generation is refused by the generation's store).
  std::string token;
  // After its ranks succeeded, how long the agent serving the store waits for the other
  // members to finish before it exits (and its store with it).
  std::chrono::milliseconds finish_wait = std::chrono::seconds(60);
  // True when this agent serves `store`: it then outlives the other members when it can.
  bool serves_store = false;
  // The ranks meet through etcd (--rdzv_backend etcd: DTRAIN_RDZV_BACKEND in
  // node.environment), so no member publishes a store address; MASTER_ADDR/MASTER_PORT are
  // node.master_addr/master_port, which play no part then (as for a plain etcd launch).
  bool ranks_on_etcd = false;
};

// Throws std::invalid_argument naming the bad option.
void validate(const ElasticOptions& options);

// Runs this host's part of the elastic job through `store` until the job ends. Returns the
// exit status: 0 when the ranks of a generation succeeded (or the job had finished before
// this agent was taken in); the failed rank's status (or 1) when restarts ran out, the host
// was left out or the store was lost; 128 + signal when a stop signal ended it.
int run_elastic(const ElasticOptions& options, std::shared_ptr<Store> store);

// The agents' store: dtrain's TCP store at host:port, presenting `token`. The agent on
// `host` serves it (the first one there when several agents share the host; `serves` says
// whether this one does); the others connect to it, waiting up to 60 s for it. It is the
// job's single point of failure: when the host serving it is lost, the job ends.
std::shared_ptr<Store> make_agent_store(const std::string& host, int port, const std::string& token,
                                        bool& serves);

// The agents' store of --rdzv_backend etcd: the etcd server(s) at `endpoints`, keys under
// "/dtrain/<run_id>/agents/" (the ranks' keys of generation N are under "/dtrain/<run_id>/N/").
// Nothing of it lives in an agent, so the job survives the loss of any host; a dead agent is
// found by its heartbeat key, which stops moving. Each call retries an unreachable etcd for
// up to 60 s, then throws dtrain::TimeoutError.
std::shared_ptr<Store> make_agent_etcd_store(const std::string& endpoints,
                                             const std::string& run_id);

}  // namespace dtrain::launcher

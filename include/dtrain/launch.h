// The launch layer: how a process learns its rank and finds its peers, how a node starts its
// ranks, and how a job stops them together.
//
//   rendezvous.h  LaunchInfo::from_env() (torchrun, mpirun, Slurm), connect_store,
//                 init_communicator: the first lines of a training program
//   launcher.h    run_node: start and supervise this node's ranks (what dtrain-run does)
//   preemption.h  StopSignal: every rank stops at the same step on SIGTERM or SIGINT
//   etcd_store.h  a Store kept in an etcd server, which outlives any host
#pragma once

#include "dtrain/etcd_store.h"
#include "dtrain/launcher.h"
#include "dtrain/preemption.h"
#include "dtrain/rendezvous.h"

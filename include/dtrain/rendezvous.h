// Rendezvous: how a rank learns who it is and finds its peers.
//
// dtrain follows torchrun's environment so that the same binary runs under torchrun,
// dtrain-run, or a cluster launcher that exports these variables:
//   MASTER_ADDR, MASTER_PORT   where rank 0 serves the TCP store
//   RANK, WORLD_SIZE           this process's global rank and the number of ranks
//   LOCAL_RANK, LOCAL_WORLD_SIZE  rank and rank count on this host (device choice, threads)
// LaunchInfo::from_env() is the only place dtrain reads them.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "dtrain/communicator.h"
#include "dtrain/store.h"

namespace dtrain {

struct LaunchInfo {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;

  // Reads the variables above. Missing variables take the defaults (a single process);
  // malformed or inconsistent values (RANK >= WORLD_SIZE, a port out of range, ...) throw
  // dtrain::InvalidArgument naming the variable.
  static LaunchInfo from_env();

  // Throws dtrain::InvalidArgument when the fields are inconsistent.
  void validate() const;
};

// Connects to (on rank 0: serves) the TCP store at master_addr:master_port.
std::shared_ptr<Store> connect_store(const LaunchInfo& info,
                                     std::chrono::milliseconds timeout = std::chrono::seconds(300));

// connect_store + make_communicator: the usual first line of a distributed program.
// A world of size 1 needs no store and never touches the network.
CommunicatorPtr init_communicator(const LaunchInfo& info, const CommunicatorOptions& options = {});

}  // namespace dtrain

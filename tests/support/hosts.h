// Several hosts on one machine, as threads: each rank's communicator claims a made-up host
// identity, as the shared-memory transport and bytes on the wire (wire_stats.h) see hosts.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/store.h"

namespace dtrain::testing {

// Rank `rank`'s communicator over `store` in a world of hosts.size() ranks, claiming host
// identity hosts[rank] (options.name keeps communicators on one store apart).
CommunicatorPtr make_host_communicator(std::shared_ptr<Store> store, int rank,
                                       const std::vector<std::string>& hosts,
                                       const CommunicatorOptions& options = {});

// Runs fn(comm) on one thread per entry of `hosts`, as run_ranks does (checks inside fn must
// throw; the first exception is rethrown after all threads ended).
void run_ranks_on_hosts(const std::vector<std::string>& hosts,
                        const std::function<void(Communicator&)>& fn,
                        const CommunicatorOptions& options = {});

}  // namespace dtrain::testing

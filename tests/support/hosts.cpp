#include "support/hosts.h"

#include <utility>

#include "comm/backend_factory.h"
#include "comm/front_end.h"
#include "support/ranks.h"

namespace dtrain::testing {

CommunicatorPtr make_host_communicator(std::shared_ptr<Store> store, int rank,
                                       const std::vector<std::string>& hosts,
                                       const CommunicatorOptions& options) {
  const int world = static_cast<int>(hosts.size());
  auto failure = std::make_shared<detail::StickyFailure>();
  auto wire = std::make_shared<detail::WireCounter>();
  auto engine = detail::make_cpu_engine(std::move(store), rank, world, options, failure, wire,
                                        hosts[static_cast<size_t>(rank)]);
  return std::make_shared<detail::FrontEnd>(rank, world, options, failure, std::move(engine),
                                            std::move(wire));
}

void run_ranks_on_hosts(const std::vector<std::string>& hosts,
                        const std::function<void(Communicator&)>& fn,
                        const CommunicatorOptions& options) {
  auto store = make_memory_store();
  run_threads(static_cast<int>(hosts.size()),
              [&](int r) { fn(*make_host_communicator(store, r, hosts, options)); });
}

}  // namespace dtrain::testing

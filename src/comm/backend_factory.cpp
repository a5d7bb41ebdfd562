#include "comm/backend_factory.h"

#include <map>
#include <vector>

#include <fmt/format.h>

#include "comm/gloo/gloo_transport.h"
#include "comm/shm/hierarchical_transport.h"
#include "comm/shm/host.h"
#include "comm/shm/setup.h"
#include "comm/shm/shm_transport.h"
#include "comm/staging_transport.h"
#include "dtrain/config.h"
#include "dtrain/errors.h"
#if DTRAIN_HAS_NCCL
#include "comm/nccl/nccl_transport.h"
#endif
#if DTRAIN_HAS_MPI
#include "comm/mpi/mpi_communicator.h"
#endif

namespace dtrain::detail {
namespace {

struct Request {
  Transport asked = Transport::kAuto;
  std::string host;  // host_identity()
};

// "<transport>\n<host identity>": what each rank publishes.
Bytes encode(const Request& r) {
  const std::string s = fmt::format("{}\n{}", to_string(r.asked), r.host);
  return Bytes(s.begin(), s.end());
}

Request decode(const Bytes& b) {
  const std::string s(b.begin(), b.end());
  const size_t nl = s.find('\n');
  Request r;
  const std::string asked = s.substr(0, nl);
  r.asked = asked == to_string(Transport::kGloo)           ? Transport::kGloo
            : asked == to_string(Transport::kSharedMemory) ? Transport::kSharedMemory
                                                           : Transport::kAuto;
  r.host = nl == std::string::npos ? "" : s.substr(nl + 1);
  return r;
}

std::string first_word(const std::string& s) { return s.substr(0, s.find(' ')); }

// Every rank's request, in rank order.
std::vector<Request> exchange_requests(Store& store, int rank, int world,
                                       const CommunicatorOptions& options, const Request& mine,
                                       const ErrorContext& ctx) {
  const std::string prefix = fmt::format("dtrain/shm/{}/request/", options.name);
  store.set(prefix + std::to_string(rank), encode(mine));
  std::vector<Request> all;
  for (int r = 0; r < world; ++r) {
    try {
      all.push_back(decode(store.get(prefix + std::to_string(r), options.timeout)));
    } catch (const TimeoutError&) {
      throw TimeoutError(ctx, fmt::format("not every rank joined within {} ms (rank {} did not)",
                                          options.timeout.count(), r));
    }
  }
  return all;
}

}  // namespace

std::unique_ptr<CollectiveEngine> make_cpu_engine(std::shared_ptr<Store> store, int rank, int world,
                                                  const CommunicatorOptions& options,
                                                  std::shared_ptr<StickyFailure> failure,
                                                  std::shared_ptr<WireCounter> wire,
                                                  const std::string& identity) {
  const ErrorContext ctx{rank, world, "make_communicator", -1};
  const std::vector<Request> all =
      exchange_requests(*store, rank, world, options, {options.transport, identity}, ctx);
  int gloo = -1, shm = -1, other_host = -1;
  shm::HostLayout layout;
  std::vector<int> host_of(static_cast<size_t>(world));
  std::map<std::string, size_t> host_index;
  for (int r = 0; r < world; ++r) {
    const Request& q = all[static_cast<size_t>(r)];
    if (q.asked == Transport::kGloo && gloo < 0) gloo = r;
    if (q.asked == Transport::kSharedMemory && shm < 0) shm = r;
    if (q.host != all[0].host && other_host < 0) other_host = r;
    auto [it, added] = host_index.emplace(q.host, layout.hosts.size());
    if (added) layout.hosts.emplace_back();
    if (r == rank) {
      layout.host = static_cast<int>(it->second);
      layout.local = static_cast<int>(layout.hosts[it->second].size());
    }
    layout.hosts[it->second].push_back(r);
    host_of[static_cast<size_t>(r)] = static_cast<int>(it->second);
  }
  bool uniform = true;
  for (const auto& h : layout.hosts) uniform = uniform && h.size() == layout.hosts[0].size();
  if (gloo >= 0 && shm >= 0) {
    throw InvalidArgument(ctx, fmt::format("rank {} asks for transport gloo, rank {} for "
                                           "shared_memory (CommunicatorOptions::transport, "
                                           "DTRAIN_TRANSPORT): ranks must agree",
                                           gloo, shm));
  }
  if (shm >= 0 && other_host >= 0 && !uniform) {
    throw InvalidArgument(
        ctx,
        fmt::format("transport shared_memory across hosts needs the same number of ranks on "
                    "every host, but rank 0's host {} has {} and rank {}'s host {} has {}",
                    first_word(all[0].host), layout.hosts[0].size(), other_host,
                    first_word(all[static_cast<size_t>(other_host)].host),
                    layout.hosts[host_index[all[static_cast<size_t>(other_host)].host]].size()));
  }
  // Gloo is built in every case: it carries send/recv, and is the fallback.
  auto gloo_engine = gloo_backend::make_gloo_transport(store, rank, world, options, failure,
                                                       WireTally{wire, host_of});
  if (gloo >= 0) return gloo_engine;
  if (other_host >= 0) {
    if (!uniform || (layout.hosts[0].size() < 2 && shm < 0)) return gloo_engine;
    return shm::make_hierarchical_transport(std::move(store), rank, world, options,
                                            std::move(failure), std::move(wire), std::move(layout),
                                            std::move(gloo_engine));
  }
  std::optional<shm::Segment> segment = shm::join_segment(*store, rank, world, options, shm >= 0);
  if (!segment) return gloo_engine;
  return shm::make_shm_transport(std::move(*segment), std::move(store), rank, world,
                                 std::move(failure), std::move(wire), std::move(gloo_engine));
}

void check_options(const CommunicatorOptions& options, const ErrorContext& ctx) {
  if (options.timeout.count() <= 0) throw InvalidArgument(ctx, "timeout must be positive");
  if (options.consistency != Consistency::kCheap &&
      options.consistency != Consistency::kFingerprint) {
    throw InvalidArgument(ctx, "unknown consistency level");
  }
  if (options.transport != Transport::kAuto && options.transport != Transport::kGloo &&
      options.transport != Transport::kSharedMemory) {
    throw InvalidArgument(ctx, "unknown transport");
  }
  if (options.mpi_progress != MpiProgress::kAuto && options.mpi_progress != MpiProgress::kThread &&
      options.mpi_progress != MpiProgress::kCaller) {
    throw InvalidArgument(ctx, "unknown mpi_progress");
  }
}

std::unique_ptr<CollectiveEngine> on_device(std::unique_ptr<CollectiveEngine> engine,
                                            const CommunicatorOptions& options, int rank,
                                            std::shared_ptr<StickyFailure> failure,
                                            const ErrorContext& ctx) {
  if (options.device.is_cpu()) return engine;
  return make_staging_transport(std::move(engine), options.device, rank, std::move(failure), ctx);
}

std::unique_ptr<CollectiveEngine> make_engine(std::shared_ptr<Store> store, int rank,
                                              int world_size, const CommunicatorOptions& options,
                                              std::shared_ptr<StickyFailure> failure,
                                              std::shared_ptr<WireCounter> wire,
                                              const ErrorContext& ctx) {
  switch (options.backend) {
    case Backend::kGloo: {
      auto engine = make_cpu_engine(store, rank, world_size, options, failure, std::move(wire),
                                    shm::host_identity());
      return on_device(std::move(engine), options, rank, std::move(failure), ctx);
    }
    case Backend::kMpi:
#if DTRAIN_HAS_MPI
      return on_device(mpi_backend::make_mpi_transport(std::move(store), rank, world_size, options,
                                                       failure, ctx),
                       options, rank, failure, ctx);
#else
      throw InvalidArgument(ctx,
                            "this dtrain was built without MPI (DTRAIN_WITH_MPI=OFF or no MPI "
                            "found at configure time; Debian: libopenmpi-dev)");
#endif
    case Backend::kNccl:
#if DTRAIN_HAS_NCCL
      return nccl_backend::make_nccl_transport(std::move(store), rank, world_size, options,
                                               std::move(failure));
#else
      throw InvalidArgument(ctx,
                            "this dtrain was built without NCCL (DTRAIN_WITH_NCCL=OFF or "
                            "CUDA/NCCL not found at configure time)");
#endif
  }
  throw InvalidArgument(ctx, "unknown backend");
}

}  // namespace dtrain::detail

#include <map>
#include <vector>

#include <fmt/format.h>

#include "comm/gloo/gloo_transport.h"
#include "comm/shm/host.h"
#include "comm/shm/setup.h"
#include "comm/shm/shm_transport.h"

namespace dtrain::shm {
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

}  // namespace

std::unique_ptr<detail::Transport> make_host_transport(
    std::shared_ptr<Store> store, int rank, int world, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure) {
  const ErrorContext ctx{rank, world, "make_communicator", -1};
  const std::string prefix = fmt::format("dtrain/shm/{}/request/", options.name);
  store->set(prefix + std::to_string(rank), encode({options.transport, host_identity()}));
  std::vector<Request> all;
  for (int r = 0; r < world; ++r) {
    try {
      all.push_back(decode(store->get(prefix + std::to_string(r), options.timeout)));
    } catch (const TimeoutError&) {
      throw TimeoutError(ctx, fmt::format("not every rank joined within {} ms (rank {} did not)",
                                          options.timeout.count(), r));
    }
  }
  int gloo = -1, shm = -1, other_host = -1;
  for (int r = 0; r < world; ++r) {
    const Request& q = all[static_cast<size_t>(r)];
    if (q.asked == Transport::kGloo && gloo < 0) gloo = r;
    if (q.asked == Transport::kSharedMemory && shm < 0) shm = r;
    if (q.host != all[0].host && other_host < 0) other_host = r;
  }
  if (gloo >= 0 && shm >= 0) {
    throw InvalidArgument(ctx, fmt::format("rank {} asks for transport gloo, rank {} for "
                                           "shared_memory (CommunicatorOptions::transport, "
                                           "DTRAIN_TRANSPORT): ranks must agree",
                                           gloo, shm));
  }
  if (shm >= 0 && other_host >= 0) {
    throw InvalidArgument(
        ctx, fmt::format("transport shared_memory needs every rank on one host, but rank 0 runs on "
                         "{} and rank {} on {} (or in another container or namespace of it)",
                         first_word(all[0].host), other_host,
                         first_word(all[static_cast<size_t>(other_host)].host)));
  }
  // Gloo is built in every case: it carries send/recv, and is the fallback.
  auto gloo_transport = gloo_backend::make_gloo_transport(store, rank, world, options, failure);
  if (gloo >= 0 || other_host >= 0) return gloo_transport;
  std::optional<Segment> segment = join_segment(*store, rank, world, options, shm >= 0);
  if (!segment) return gloo_transport;
  return make_shm_transport(std::move(*segment), std::move(store), rank, world, std::move(failure),
                            std::move(gloo_transport));
}

}  // namespace dtrain::shm

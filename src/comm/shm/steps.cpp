#include <vector>

#include <fmt/format.h>

#include "comm/shm/algorithms.h"

namespace dtrain::shm {

void Steps::sync(size_t chunk, size_t chunks) {
  barrier_.arrive_and_wait(deadline_, timeout_,
                           fmt::format("reach chunk {}/{} of {}", chunk + 1, chunks, label_));
}

void check_headers(const Segment& segment, Barrier& barrier, int rank,
                   const detail::Collective& call, Clock::time_point deadline) {
  const auto seq = static_cast<uint64_t>(call.context.sequence);
  segment.slot(rank).headers[seq % 2] = call.header;
  barrier.arrive_and_wait(deadline, call.timeout, fmt::format("issue collective #{}", seq));
  std::vector<detail::CallHeader> headers(static_cast<size_t>(segment.world_size()));
  for (int r = 0; r < segment.world_size(); ++r)
    headers[static_cast<size_t>(r)] = segment.slot(r).headers[seq % 2];
  if (auto cause = detail::find_mismatch(headers)) throw DesyncError(*cause);
}

}  // namespace dtrain::shm

#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/shm/host.h"
#include "comm/shm/setup.h"

namespace dtrain::shm {
namespace {

constexpr const char* kErrorPrefix = "error:";

std::string key(const CommunicatorOptions& o, const std::string& what) {
  return fmt::format("dtrain/shm/{}/{}", o.name, what);
}

void wait_all_mapped(Store& store, int world, const CommunicatorOptions& o,
                     const std::string& name) {
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(key(o, fmt::format("mapped/{}", r)));
  try {
    store.wait(keys, o.timeout);
  } catch (const TimeoutError&) {
    std::vector<int> missing;
    for (int r = 0; r < world; ++r) {
      if (!store.check({keys[static_cast<size_t>(r)]})) missing.push_back(r);
    }
    throw TimeoutError(fmt::format("rank(s) {} did not map shared-memory segment {} within {} ms",
                                   fmt::join(missing, ", "), name, o.timeout.count()));
  }
}

}  // namespace

std::optional<Segment> join_segment(Store& store, int rank, int world, const CommunicatorOptions& o,
                                    bool required) {
  const ErrorContext ctx{rank, world, "connect (shared memory)", -1};
  std::string name;
  std::optional<Segment> seg;
  try {
    if (rank == 0) {
      std::string published;
      try {
        seg.emplace(create_unique_segment(world, o.shm_chunk_bytes));
        published = name = seg->name();
      } catch (const Error& e) {
        published = kErrorPrefix + e.cause();
        if (!required)
          fmt::print(stderr, "dtrain: no shared memory for communicator '{}' ({}); using Gloo\n",
                     o.name, e.cause());
      }
      store.set(key(o, "segment"), Bytes(published.begin(), published.end()));
      if (!seg && required) throw CommError(published.substr(std::strlen(kErrorPrefix)));
    } else {
      const Bytes b = store.get(key(o, "segment"), o.timeout);
      const std::string published(b.begin(), b.end());
      if (published.rfind(kErrorPrefix, 0) == 0) {
        if (required)
          throw CommError("rank 0 could not create the shared-memory segment: " +
                          published.substr(std::strlen(kErrorPrefix)));
      } else {
        name = published;
        seg.emplace(Segment::open(name, world));
      }
    }
    if (!seg) return std::nullopt;
    const ProcessId me = this_process();
    RankSlot& slot = seg->slot(rank);
    slot.pid.store(me.pid);
    slot.start_time.store(me.start_time);
    slot.state.store(static_cast<uint32_t>(RankState::kReady));
    store.set(key(o, fmt::format("mapped/{}", rank)), Bytes{1});
    wait_all_mapped(store, world, o, name);
  } catch (const TimeoutError& e) {
    if (!name.empty()) unlink_segment(name);
    throw TimeoutError(ctx, e.cause());
  } catch (const Error& e) {
    if (!name.empty()) unlink_segment(name);
    throw CommError(ctx, e.cause());
  }
  unlink_segment(name);  // every rank tries; the first one removes it
  return seg;
}

}  // namespace dtrain::shm

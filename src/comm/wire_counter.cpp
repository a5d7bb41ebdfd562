#include "comm/wire_counter.h"

namespace dtrain::detail {

WireKind wire_kind(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce:
      return WireKind::kAllReduce;
    case CollectiveOp::kBroadcast:
      return WireKind::kBroadcast;
    case CollectiveOp::kAllGather:
      return WireKind::kAllGather;
    case CollectiveOp::kReduceScatter:
      return WireKind::kReduceScatter;
    case CollectiveOp::kBarrier:
      return WireKind::kControl;
  }
  return WireKind::kControl;
}

WireStats WireCounter::snapshot() const {
  auto at = [&](WireKind k) {
    const size_t i = static_cast<size_t>(k) * 2;
    WireBytes b;
    b.intra_host = counts_[i].load(std::memory_order_relaxed);
    b.inter_host = counts_[i + 1].load(std::memory_order_relaxed);
    return b;
  };
  WireStats s;
  s.counted = true;
  s.all_reduce = at(WireKind::kAllReduce);
  s.broadcast = at(WireKind::kBroadcast);
  s.all_gather = at(WireKind::kAllGather);
  s.reduce_scatter = at(WireKind::kReduceScatter);
  s.point_to_point = at(WireKind::kPointToPoint);
  s.control = at(WireKind::kControl);
  return s;
}

}  // namespace dtrain::detail

// What dtrain's tests and benchmarks read of the strategies' internals: bucket layouts, FSDP's
// collective log and unit order. Not part of the public surface (include/dtrain): the classes
// name detail::Inspect a friend, and only code that sees src/ reaches it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "dtrain/data_parallel.h"
#include "dtrain/fsdp.h"

namespace dtrain::detail {

struct Inspect {
  // Parameter indices (in module->parameters() order) of each bucket, in launch order.
  static std::vector<std::vector<size_t>> bucket_assignment(const DataParallel& ddp);
  // Collectives issued in the last step, e.g. "all_gather:h.0", "reduce_scatter:h.1".
  static std::vector<std::string> last_collective_log(const FullyShardedDataParallel& fsdp);
  // Unit names in execution (forward) order, as recorded in the first iteration.
  static std::vector<std::string> unit_order(const FullyShardedDataParallel& fsdp);
};

// Groups parameters into buckets for DataParallel: walks `order` (indices into sizes),
// starting a new bucket when adding the next parameter would exceed the cap (the first
// bucket's cap is first_cap_bytes) or when the dtype changes. A parameter larger than
// the cap gets a bucket of its own.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& order,
                                                const std::vector<int64_t>& bytes,
                                                const std::vector<int>& dtype_ids,
                                                int64_t first_cap_bytes, int64_t cap_bytes);

}  // namespace dtrain::detail

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "strategy/inspect.h"

namespace dtrain::detail {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& order,
                                                const std::vector<int64_t>& bytes,
                                                const std::vector<int>& dtype_ids,
                                                int64_t first_cap_bytes, int64_t cap_bytes) {
  if (bytes.size() != dtype_ids.size()) {
    throw InvalidArgument("assign_buckets: bytes and dtype_ids differ in length");
  }
  if (first_cap_bytes <= 0 || cap_bytes <= 0) {
    throw InvalidArgument(fmt::format("assign_buckets: caps must be positive (got {} and {})",
                                      first_cap_bytes, cap_bytes));
  }
  std::vector<std::vector<size_t>> buckets;
  int64_t filled = 0;
  for (size_t i : order) {
    if (i >= bytes.size()) {
      throw InvalidArgument(fmt::format("assign_buckets: index {} out of range", i));
    }
    // The bucket being filled is the first one while only one exists.
    const int64_t cap = buckets.size() == 1 ? first_cap_bytes : cap_bytes;
    const bool fits = !buckets.empty() && filled + bytes[i] <= cap &&
                      dtype_ids[buckets.back().front()] == dtype_ids[i];
    if (!fits) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(i);
    filled += bytes[i];
  }
  return buckets;
}

}  // namespace dtrain::detail

#include "comm/reduce/reduce_ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace dtrain::reduce {
namespace {

struct Sum {
  template <typename T>
  static T apply(T a, T b) {
    return a + b;
  }
};
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    return std::min(a, b);
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    return std::max(a, b);
  }
};

// Arithmetic type used to combine two elements of storage type T.
template <typename T>
struct Compute {
  using type = T;
};
template <>
struct Compute<c10::Half> {
  using type = float;
};
template <>
struct Compute<c10::BFloat16> {
  using type = float;
};

template <typename T, typename Op>
void elementwise(void* c, const void* a, const void* b, size_t n) {
  using C = typename Compute<T>::type;
  auto* out = static_cast<T*>(c);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<T>(Op::apply(static_cast<C>(x[i]), static_cast<C>(y[i])));
  }
}

template <typename T>
ReduceFn for_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return &elementwise<T, Sum>;
    case ReduceOp::kMin:
      return &elementwise<T, Min>;
    case ReduceOp::kMax:
      return &elementwise<T, Max>;
  }
  return nullptr;
}

}  // namespace

bool is_supported_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kBFloat16:
    case c10::kByte:
    case c10::kChar:
    case c10::kShort:
    case c10::kInt:
    case c10::kLong:
      return true;
    default:
      return false;
  }
}

ReduceFn reduce_fn(c10::ScalarType dtype, ReduceOp op) {
  if (op == ReduceOp::kAvg && !c10::isFloatingType(dtype)) {
    throw InvalidArgument(
        fmt::format("ReduceOp avg needs a floating dtype, got {}", c10::toString(dtype)));
  }
  switch (dtype) {
    case c10::kFloat:
      return for_op<float>(op);
    case c10::kDouble:
      return for_op<double>(op);
    case c10::kHalf:
      return for_op<c10::Half>(op);
    case c10::kBFloat16:
      return for_op<c10::BFloat16>(op);
    case c10::kByte:
      return for_op<uint8_t>(op);
    case c10::kChar:
      return for_op<int8_t>(op);
    case c10::kShort:
      return for_op<int16_t>(op);
    case c10::kInt:
      return for_op<int32_t>(op);
    case c10::kLong:
      return for_op<int64_t>(op);
    default:
      throw InvalidArgument(fmt::format("dtype {} cannot be reduced", c10::toString(dtype)));
  }
}

}  // namespace dtrain::reduce

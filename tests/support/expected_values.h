// Closed-form collective inputs and their expected reductions, computed in double and
// shared by the Gloo and NCCL collective tests (so both check against the same reference).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "dtrain/communicator.h"

namespace dtrain::testing {

// Small integers: exact in every dtype, and sums of up to 4 ranks fit in int8.
inline double value(int rank, int64_t i) { return static_cast<double>((rank * 3 + i) % 5 + rank); }

// The reduction over `world` ranks of value(r, i).
inline double reduce_expected(ReduceOp op, int world, int64_t i) {
  double acc = value(0, i);
  for (int r = 1; r < world; ++r) {
    double v = value(r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  return op == ReduceOp::kAvg ? acc / world : acc;
}

// Comparison tolerance per dtype: rounding of the result (exact for integer types).
inline double tolerance(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return 1e-3;
    case at::kBFloat16:
      return 1e-2;
    case at::kFloat:
      return 1e-6;
    default:
      return 0.0;
  }
}

}  // namespace dtrain::testing

// Element-wise reductions of the CPU transports (Gloo, shared memory, hierarchical), for every
// dtype dtrain communicates. Gloo has no bfloat16 type: half and bfloat16 are reduced in float
// and rounded back, as c10 does.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <functional>

#include "dtrain/communicator.h"

namespace dtrain::reduce {

// c[i] = a[i] op b[i] for n elements; c may alias a or b. kAvg reduces as kSum (the
// division happens once, after the collective).
using ReduceFn = void (*)(void* c, const void* a, const void* b, size_t n);

// Throws dtrain::InvalidArgument for a dtype/op pair dtrain does not reduce.
ReduceFn reduce_fn(c10::ScalarType dtype, ReduceOp op);

// Whether dtrain can communicate tensors of this dtype at all.
bool is_supported_dtype(c10::ScalarType dtype);

}  // namespace dtrain::reduce

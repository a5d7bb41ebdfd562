// Low-rank factor helpers of the PowerSGD hook, unit tested alone.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dtrain::detail {

// Makes the rows of `rows` (r x n, r <= n, fp32, contiguous) an orthonormal basis in place
// whose first k rows span the first k input rows (Householder QR in fp32): rows dependent on
// earlier ones, or zero, become unit rows orthogonal to the others, never NaN. Throws
// InvalidArgument for another dtype or shape.
void orthonormalize_rows(at::Tensor rows);

// The seed of the random Q a PowerSGD bucket draws at `step`: a function of its inputs only,
// identical on every rank and in a resumed run.
uint64_t powersgd_q_seed(uint64_t seed, int64_t step, int bucket);

}  // namespace dtrain::detail

// The collectives matrix every CPU transport is held to (Gloo, shared memory, hierarchical):
// every collective x dtype x reduction x size, against values computed here in double from
// closed-form inputs (expected_values.h), never by dtrain.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/communicator.h"

namespace dtrain::testing {

// value(rank, offset + i) for i in [0, n), in `dtype`.
at::Tensor make_input(c10::ScalarType dtype, int64_t n, int rank, int64_t offset = 0);

// Throws (DTRAIN_CHECK) naming `what` and the first element of `got` off want(i) by more
// than the dtype's tolerance.
void expect_values(const at::Tensor& got, const std::function<double(int64_t)>& want,
                   const std::string& what);

// Every dtype a CPU transport moves.
const std::vector<c10::ScalarType>& all_dtypes();
// Empty, one, odd, and several MiB for the floating types that carry gradients (the large
// case exercises a transport's pipelining: Gloo's ring, shared memory's chunks).
std::vector<int64_t> sizes_for(c10::ScalarType dtype);
// Every reduction `dtype` supports (kAvg for floating types only).
std::vector<ReduceOp> ops_for(c10::ScalarType dtype);
// "all_reduce float32 n=7 rank 1": what a failed check names.
std::string label(const char* op, c10::ScalarType dtype, int64_t n, int rank);

// On rank `c` (which must run on `transport`, Communicator::transport_name()): all_reduce
// and reduce_scatter (input untouched) for every reduction, broadcast from the last rank,
// all_gather also in place, for every dtype and for `sizes` (empty: sizes_for); `tag` is added
// to every message. Checks throw, as checks inside rank threads must.
void run_collective_matrix(Communicator& c, const std::string& transport,
                           const std::vector<int64_t>& sizes = {}, const std::string& tag = "");

}  // namespace dtrain::testing

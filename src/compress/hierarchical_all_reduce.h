// DataParallel's quantised gradients in two levels (quantized_allreduce_hook with a host
// group): ZeRO++'s hierarchical qgZ turned into an all-reduce.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtrain/communicator.h"
#include "dtrain/quantization.h"
#include "dtrain/work.h"

namespace dtrain::detail {

// Averages `tensor` (1-D, floating, any length) over the ranks of `comm`, identically on
// every rank, once the Work is waited for. `host` holds this rank's host: ranks
// [hL, (h + 1)L) of `comm` in order (check_host_layout). The tensor, padded to a multiple of
// the world size, is cut into one chunk per rank:
//  1. hierarchical_quantized_reduce_scatter: rank r gets chunk r averaged (fp32 inside the
//     host, each other host's sum quantised once);
//  2. when the Work is waited for, each owner quantises its averaged chunk and swaps it,
//     point to point over `comm`, with the ranks of the same local index on the other
//     hosts; every rank (the owner too) takes the dequantised values;
//  3. an fp32 all-gather inside the host completes the tensor.
// Each value crosses hosts twice, quantised: 2 (H - 1) / H of the tensor per host each way
// (H hosts), against a flat exchange's L times more. Per element, |error| <= the reduce-
// scatter's bound plus one quantisation of the averaged chunk (int8: max|block| / 254).
// Step 2 issues its calls inside the Work's wait(): every rank must wait for these Works in
// the same order, after issuing all of them (DataParallel waits for its buckets in order
// once backward has issued them all), and nothing else may use point-to-point calls on
// `comm` meanwhile.
WorkPtr hierarchical_quantized_all_reduce(Communicator& comm, Communicator& host, at::Tensor tensor,
                                          Quantization q, int64_t block);

}  // namespace dtrain::detail

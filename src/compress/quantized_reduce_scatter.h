// Reduce-scatter with the chunks quantised on the wire (FSDP's gradient reduction under
// FsdpOptions::quantize_grads, ZeRO++'s qgZ), reduced in fp32 after dequantising.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtrain/communicator.h"
#include "dtrain/quantization.h"
#include "dtrain/work.h"

namespace dtrain::detail {

// Like comm.reduce_scatter(output, input, kAvg): `input` (1-D, floating, world * n) holds one
// chunk of n values per rank; rank r's `output` (n values) gets the average over ranks of
// their chunk r once the Work is waited for. Every rank quantises each peer's chunk
// separately (blocks start at the chunk's start) and sends it to that peer, point to point;
// the receiver dequantises each peer's chunk into fp32 and adds them, its own chunk exact,
// in rank order, then divides by the world size. No value is ever summed in low precision.
// Per element of rank r's result (x_p: rank p's chunk r):
//   bf16: |error| <= (1 / world) sum_{p != r} 2^-8 |x_p|
//   int8: |error| <= (1 / world) sum_{p != r} max|block of x_p holding it| / 254
// (plus fp32 round-off of the sum). The exchange is a round-robin of pairwise swaps (world - 1
// rounds, world when odd), the lower rank of a pair sending first, so it cannot deadlock even
// where point-to-point calls of one rank run one after another (NCCL). Uses tag 0 (NCCL's
// only tag): nothing else may use point-to-point calls on `comm` concurrently. `wire_bytes`:
// this rank's input in the wire format (world quantised chunks), as a plain reduce-scatter
// counts its fp32 input.
WorkPtr quantized_reduce_scatter(Communicator& comm, at::Tensor output, const at::Tensor& input,
                                 Quantization q, int64_t block, int64_t* wire_bytes);

// The partner of `rank` in round `round` of the pairwise exchange among `world` ranks (the
// circle method); -1 when it sits the round out (odd world). Rounds: world - 1 when even,
// world when odd. Exposed for its test.
int exchange_partner(int rank, int world, int round);
int exchange_rounds(int world);

}  // namespace dtrain::detail

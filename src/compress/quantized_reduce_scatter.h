// Reduce-scatter with the chunks quantised on the wire (FSDP's gradient reduction under
// FsdpOptions::quantize_grads, ZeRO++'s qgZ), reduced in fp32 after dequantising.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

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
//   int4: the same with / 14
// (plus fp32 round-off of the sum). The exchange is a round-robin of pairwise swaps (world - 1
// rounds, world when odd), the lower rank of a pair sending first, so it cannot deadlock even
// where point-to-point calls of one rank run one after another (NCCL). Uses tag 0 (NCCL's
// only tag): nothing else may use point-to-point calls on `comm` concurrently. `wire_bytes`:
// this rank's input in the wire format (world quantised chunks), as a plain reduce-scatter
// counts its fp32 input.
WorkPtr quantized_reduce_scatter(Communicator& comm, at::Tensor output, const at::Tensor& input,
                                 Quantization q, int64_t block, int64_t* wire_bytes);

// Two levels, as ZeRO++'s hierarchical qgZ. `host` holds the ranks of this rank's host:
// ranks [hL, (h + 1)L) of `comm` in order (L = host.world_size() divides comm's world size;
// check_host_layout verifies it). Inside the host, an fp32 reduce-scatter (sum) gives local
// rank i its host's sum of every chunk gL + i; between hosts, each such sum goes quantised,
// point to point over `comm`, to its owner gL + i, which adds its own host's sum exactly and
// the others' dequantised, in host order, and divides by the world size. Each value crosses
// hosts once, as one host's sum: L times fewer inter-host bytes than the flat exchange, and
// the error bound per element of rank r's result (s_g: host g's sum of chunk r) is
//   (1 / world) sum_{g != own host} bf16: 2^-8 |s_g|; int8: max|block of s_g| / 254;
//                                   int4: max|block of s_g| / 14
// (no larger than the flat exchange's). The host's reduce-scatter is waited for before the
// exchange is issued; the same tag rule as above. `wire_bytes`: the host reduce-scatter's
// fp32 input plus the quantised host sums.
WorkPtr hierarchical_quantized_reduce_scatter(Communicator& comm, Communicator& host,
                                              at::Tensor output, const at::Tensor& input,
                                              Quantization q, int64_t block, int64_t* wire_bytes);

// Throws InvalidArgument unless `host`'s ranks are ranks [hL, (h + 1)L) of `comm` in order
// (make_host_group's layout). A collective of `host` (one all-gather of its ranks).
void check_host_layout(Communicator& comm, Communicator& host);

// The pairwise swap under both forms and the two-level all-reduce: with each peer p (a rank
// of `comm`; this rank is peers[me]), sends bytes [p b, (p + 1) b) of `sent` and receives
// into the same range of `received` (b = `bytes`), in the round-robin below. Returns the
// sends' and receives' Works.
std::vector<WorkPtr> swap_with_peers(Communicator& comm, const std::vector<int>& peers, int me,
                                     const at::Tensor& sent, const at::Tensor& received,
                                     int64_t bytes);

// The partner of `rank` in round `round` of the pairwise exchange among `world` ranks (the
// circle method); -1 when it sits the round out (odd world). Rounds: world - 1 when even,
// world when odd. Exposed for its test.
int exchange_partner(int rank, int world, int round);
int exchange_rounds(int world);

}  // namespace dtrain::detail

// Quantised communication: gradients and parameters sent in 8 or 16 bits and turned back
// into fp32 before anything is added up (no accumulation in low precision).
//
//   kBf16: each value rounded to bfloat16 (round to nearest even): 2 bytes per value,
//          |error| <= 2^-8 |x| for normal values.
//   kInt8: blockwise: each block of `block_size` consecutive values shares one fp32 scale
//          (the block's largest magnitude / 127) and each value is round(x / scale) in
//          [-127, 127]: 1 byte per value plus 4 per block, |error| <= max|block| / 254.
//          A block of zeros stays zeros. Inputs must be finite.
//   kInt4: the same blocks with 4-bit values in [-7, 7] (scale = max|block| / 7), two per
//          byte: half a byte per value plus 4 per block, |error| <= max|block| / 14. For
//          gradients (ZeRO++'s qgZ sends int4 gradients), where the error averages out over
//          steps; parameters in int4 lose too much.
//
// Used by quantized_allreduce_hook (DataParallel) and FsdpOptions::quantize_params (FSDP's
// parameter all-gather). docs/strategies.md, "Quantised communication", has the traffic.
#pragma once

#include <cstdint>
#include <memory>

#include "dtrain/comm_hook.h"
#include "dtrain/communicator.h"

namespace dtrain {

enum class Quantization { kNone, kBf16, kInt8, kInt4 };

const char* to_string(Quantization q);  // "none", "bf16", "int8", "int4"

// Default int8 block: 4 bytes of scale per 256 values (1.6% on top of the int8 values).
inline constexpr int64_t kDefaultQuantizationBlock = 256;

// DataParallel hook: gradients quantised on the wire, averaged in fp32, the same result on
// every rank. Throws InvalidArgument for block_size < 1; kNone is allreduce_hook().
//
// Without `host_group` (or with one holding every rank, or one rank): every rank quantises
// its bucket, the quantised buckets are all-gathered, and each rank dequantises every
// rank's bucket and averages them in rank order. Traffic per rank: (world - 1) quantised
// buckets received, against 2 (world - 1) / world fp32 buckets for a ring all-reduce: int8
// sends about 4x less at 2 ranks, 2x at 4, the same at 8; bf16 2x at 2 ranks, the same at 4.
//
// With `host_group` (the ranks of this host, consecutive ranks of DataParallel's
// communicator in order: make_host_group; every rank passes one; checked on the first
// bucket), in two levels, as ZeRO++'s hierarchical qgZ: an fp32 reduce-scatter inside the
// host, each host's sum quantised once to the rank owning that chunk on the other hosts,
// the averaged chunk quantised once more back to them, and an fp32 all-gather inside the
// host. Inter-host bytes: a quarter of the hierarchical fp32 all-reduce's for int8 (plus
// 4 per block), an eighth for int4, at any number of hosts; the intra-host steps go over
// shared memory. The error per value is at most two quantisations' (the other hosts' sums,
// averaged, and the average); docs/strategies.md, "Quantised communication".
std::shared_ptr<CommHook> quantized_allreduce_hook(Quantization q,
                                                   int64_t block_size = kDefaultQuantizationBlock,
                                                   CommunicatorPtr host_group = nullptr);

}  // namespace dtrain

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

namespace dtrain {

enum class Quantization { kNone, kBf16, kInt8, kInt4 };

const char* to_string(Quantization q);  // "none", "bf16", "int8", "int4"

// Default int8 block: 4 bytes of scale per 256 values (1.6% on top of the int8 values).
inline constexpr int64_t kDefaultQuantizationBlock = 256;

// DataParallel hook: every rank quantises its bucket, the quantised buckets are all-gathered,
// and each rank dequantises every rank's bucket and averages them in fp32, in rank order (so
// every rank gets the same result). Traffic per rank: (world - 1) quantised buckets received,
// against 2 (world - 1) / world fp32 buckets for a ring all-reduce: int8 sends about 4x less
// at 2 ranks, 2x at 4, the same at 8; bf16 2x at 2 ranks, the same at 4. kNone is
// allreduce_hook(). Throws InvalidArgument for block_size < 1.
std::shared_ptr<CommHook> quantized_allreduce_hook(Quantization q,
                                                   int64_t block_size = kDefaultQuantizationBlock);

}  // namespace dtrain

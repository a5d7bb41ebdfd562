// The wire format of quantised tensors (dtrain/quantization.h), unit tested alone. A
// quantised tensor is a flat uint8 tensor whose length is a multiple of 4, so that quantised
// tensors packed one after another (an all-gather's output) can each be viewed as fp32
// scales in place.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtrain/quantization.h"

namespace dtrain::detail {

// Bytes of a quantised tensor of `numel` values:
//   bf16: 2 numel, rounded up to a multiple of 4;
//   int8: 4 ceil(numel / block) (the scales) + numel (the values), rounded up likewise;
//   int4: 4 ceil(numel / block) + ceil(numel / 2), rounded up likewise.
int64_t quantized_bytes(Quantization q, int64_t numel, int64_t block);

// Writes `src` (1-D, floating, contiguous) quantised into `dst` (uint8, quantized_bytes long,
// on src's device). Throws InvalidArgument naming what is wrong.
void quantize(const at::Tensor& src, at::Tensor dst, Quantization q, int64_t block);

// Reads `src` (what quantize wrote for dst.numel() values) into `dst` (1-D, floating,
// contiguous), converting to dst's dtype.
void dequantize(const at::Tensor& src, at::Tensor dst, Quantization q, int64_t block);

}  // namespace dtrain::detail

#include "compress/quantize.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace dtrain {

const char* to_string(Quantization q) {
  switch (q) {
    case Quantization::kNone:
      return "none";
    case Quantization::kBf16:
      return "bf16";
    case Quantization::kInt8:
      return "int8";
    case Quantization::kInt4:
      return "int4";
  }
  return "?";
}

namespace detail {
namespace {

int64_t round_up4(int64_t n) { return (n + 3) / 4 * 4; }
int64_t num_blocks(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

void check(bool ok, const char* op, const std::string& why) {
  if (!ok) throw InvalidArgument(ErrorContext{-1, -1, op, -1}, why);
}

void check_args(const at::Tensor& values, const at::Tensor& bytes, Quantization q, int64_t block,
                const char* op) {
  check(q != Quantization::kNone, op, "nothing to do for Quantization::kNone");
  check(block >= 1, op, fmt::format("block size must be >= 1, got {}", block));
  check(values.dim() == 1 && values.is_contiguous() && at::isFloatingType(values.scalar_type()), op,
        "values must be a contiguous 1-D floating tensor");
  check(bytes.dim() == 1 && bytes.is_contiguous() && bytes.scalar_type() == at::kByte, op,
        "the quantised tensor must be a contiguous 1-D uint8 tensor");
  check(bytes.device() == values.device(), op, "values and quantised tensor on different devices");
  const int64_t want = quantized_bytes(q, values.numel(), block);
  check(bytes.numel() == want, op,
        fmt::format("{} values of {} (block {}) take {} bytes, got {}", values.numel(),
                    to_string(q), block, want, bytes.numel()));
  // An all-gather's output holds quantised tensors back to back: each must start on a
  // 4-byte boundary to be viewed as fp32 scales.
  check(bytes.storage_offset() % 4 == 0, op, "the quantised tensor must start 4-byte aligned");
}

}  // namespace

int64_t quantized_bytes(Quantization q, int64_t numel, int64_t block) {
  switch (q) {
    case Quantization::kNone:
      return numel * 4;
    case Quantization::kBf16:
      return round_up4(2 * numel);
    case Quantization::kInt8:
      return 4 * num_blocks(numel, block) + round_up4(numel);
    case Quantization::kInt4:
      return 4 * num_blocks(numel, block) + round_up4((numel + 1) / 2);
  }
  return 0;
}

void quantize(const at::Tensor& src, at::Tensor dst, Quantization q, int64_t block) {
  check_args(src, dst, q, block, "quantize");
  const int64_t n = src.numel();
  if (q == Quantization::kBf16) {
    dst.narrow(0, 0, 2 * n).view(at::kBFloat16).copy_(src);
    return;
  }
  const int64_t blocks = num_blocks(n, block);
  const double levels = q == Quantization::kInt8 ? 127.0 : 7.0;
  at::Tensor x = src.to(at::kFloat);
  // Pad the last block with zeros: they do not change its largest magnitude.
  if (blocks * block != n) x = at::constant_pad_nd(x, {0, blocks * block - n}, 0);
  x = x.view({blocks, block});
  at::Tensor scale = x.abs().amax(1) / levels;
  // A zero block has scale 0: multiply by 0 instead of dividing by it.
  at::Tensor inverse = at::where(scale > 0, scale.reciprocal(), at::zeros_like(scale));
  at::Tensor values = (x * inverse.unsqueeze(1)).round_().clamp_(-levels, levels);
  dst.narrow(0, 0, 4 * blocks).view(at::kFloat).copy_(scale);
  values = values.view({-1}).narrow(0, 0, n);
  if (q == Quantization::kInt8) {
    dst.narrow(0, 4 * blocks, n).view(at::kChar).copy_(values.to(at::kChar));
    return;
  }
  // Two values per byte, offset by 8 into [1, 15]: value 2i in the low nibble, 2i + 1 in
  // the high one (an odd count's last high nibble is 0).
  at::Tensor nibbles = (values + 8).to(at::kByte);
  if (n % 2 != 0) nibbles = at::constant_pad_nd(nibbles, {0, 1}, 0);
  nibbles = nibbles.view({-1, 2});
  at::Tensor packed = at::bitwise_or(nibbles.select(1, 0), nibbles.select(1, 1) * 16);
  dst.narrow(0, 4 * blocks, packed.numel()).copy_(packed);
}

void dequantize(const at::Tensor& src, at::Tensor dst, Quantization q, int64_t block) {
  check_args(dst, src, q, block, "dequantize");
  const int64_t n = dst.numel();
  if (q == Quantization::kBf16) {
    dst.copy_(src.narrow(0, 0, 2 * n).view(at::kBFloat16));
    return;
  }
  const int64_t blocks = num_blocks(n, block);
  at::Tensor scale = src.narrow(0, 0, 4 * blocks).view(at::kFloat);
  at::Tensor values;
  if (q == Quantization::kInt8) {
    values = src.narrow(0, 4 * blocks, n).view(at::kChar).to(at::kFloat);
  } else {
    const at::Tensor packed = src.narrow(0, 4 * blocks, (n + 1) / 2);
    values = at::stack({at::bitwise_and(packed, 15), packed.div(16, "floor")}, 1)
                 .view({-1})
                 .narrow(0, 0, n)
                 .to(at::kFloat) -
             8;
  }
  if (blocks * block != n) values = at::constant_pad_nd(values, {0, blocks * block - n}, 0);
  at::Tensor x = values.view({blocks, block}) * scale.unsqueeze(1);
  dst.copy_(x.view({-1}).narrow(0, 0, n));
}

}  // namespace detail
}  // namespace dtrain

#include <ATen/ATen.h>

#include <fmt/format.h>

#include "compress/quantize.h"
#include "dtrain/errors.h"
#include "dtrain/quantization.h"
#include "dtrain/work.h"

namespace dtrain {
namespace {

class QuantizedAllReduceHook final : public CommHook {
 public:
  QuantizedAllReduceHook(Quantization q, int64_t block) : q_(q), block_(block) {}

  WorkPtr run(Communicator& comm, GradBucket& b) override {
    const int64_t n = b.buffer.numel();
    const int64_t bytes = detail::quantized_bytes(q_, n, block_);
    const auto byte_options = b.buffer.options().dtype(at::kByte);
    at::Tensor mine = at::empty({bytes}, byte_options);
    detail::quantize(b.buffer, mine, q_, block_);
    const int world = comm.world_size();
    at::Tensor all = at::empty({bytes * world}, byte_options);
    auto gathered = comm.all_gather(all, mine);
    const Quantization q = q_;
    const int64_t block = block_;
    return then(gathered, [buffer = b.buffer, all, mine, bytes, world, n, q, block]() {
      // Dequantised and added up in fp32, in rank order: the same sum on every rank.
      const auto f32 = buffer.options().dtype(at::kFloat);
      at::Tensor sum = at::zeros({n}, f32);
      at::Tensor one = at::empty({n}, f32);
      for (int r = 0; r < world; ++r) {
        detail::dequantize(all.narrow(0, r * bytes, bytes), one, q, block);
        sum.add_(one);
      }
      buffer.copy_(sum.div_(world));
    });
  }
  std::string name() const override { return std::string("quantized_") + to_string(q_); }

 private:
  Quantization q_;
  int64_t block_;
};

}  // namespace

std::shared_ptr<CommHook> quantized_allreduce_hook(Quantization q, int64_t block_size) {
  if (block_size < 1) {
    throw InvalidArgument(ErrorContext{-1, -1, "quantized_allreduce_hook", -1},
                          fmt::format("block_size must be >= 1, got {}", block_size));
  }
  if (q == Quantization::kNone) return allreduce_hook();
  return std::make_shared<QuantizedAllReduceHook>(q, block_size);
}

}  // namespace dtrain

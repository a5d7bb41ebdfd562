#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include <fmt/format.h>

#include "compress/hierarchical_all_reduce.h"
#include "compress/quantize.h"
#include "compress/quantized_reduce_scatter.h"
#include "dtrain/errors.h"
#include "dtrain/quantization.h"
#include "dtrain/work.h"

namespace dtrain {
namespace {

class QuantizedAllReduceHook final : public CommHook {
 public:
  QuantizedAllReduceHook(Quantization q, int64_t block, CommunicatorPtr host)
      : q_(q), block_(block), host_(std::move(host)) {}

  WorkPtr run(Communicator& comm, GradBucket& b) override {
    const int local = host_ ? host_->world_size() : 1;
    if (local > 1 && local < comm.world_size()) {
      if (!host_checked_) {
        detail::check_host_layout(comm, *host_);
        host_checked_ = true;
      }
      return detail::hierarchical_quantized_all_reduce(comm, *host_, b.buffer, q_, block_);
    }
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
  std::vector<CommunicatorPtr> communicators() const override {
    if (host_) return {host_};
    return {};
  }

 private:
  Quantization q_;
  int64_t block_;
  CommunicatorPtr host_;
  bool host_checked_ = false;  // check_host_layout ran (on the first bucket)
};

}  // namespace

std::shared_ptr<CommHook> quantized_allreduce_hook(Quantization q, int64_t block_size,
                                                   CommunicatorPtr host_group) {
  if (block_size < 1) {
    throw InvalidArgument(ErrorContext{-1, -1, "quantized_allreduce_hook", -1},
                          fmt::format("block_size must be >= 1, got {}", block_size));
  }
  if (q == Quantization::kNone) return allreduce_hook();
  return std::make_shared<QuantizedAllReduceHook>(q, block_size, std::move(host_group));
}

}  // namespace dtrain

#include "compress/quantized_all_gather.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include "compress/quantize.h"
#include "dtrain/errors.h"

namespace dtrain::detail {

WorkPtr quantized_all_gather(Communicator& comm, at::Tensor output, const at::Tensor& input,
                             Quantization q, int64_t block, int64_t* wire_bytes) {
  const int world = comm.world_size();
  const int64_t n = input.numel();
  if (output.numel() != n * world) {
    throw InvalidArgument(
        ErrorContext{comm.rank(), world, "quantized_all_gather", -1},
        fmt::format("output has {} elements, {} ranks x {} expected", output.numel(), world, n));
  }
  const int64_t bytes = quantized_bytes(q, n, block);
  const auto byte_options = input.options().dtype(at::kByte);
  at::Tensor mine = at::empty({bytes}, byte_options);
  quantize(input.contiguous().view({-1}), mine, q, block);
  at::Tensor all = at::empty({bytes * world}, byte_options);
  if (wire_bytes != nullptr) *wire_bytes = bytes;
  auto gathered = comm.all_gather(all, mine);
  // variable_data(): a copy into output itself would bump the version counter its views
  // (module parameters saved by autograd) share.
  at::Tensor out = output.variable_data();
  return then(gathered, [out, all, mine, bytes, world, n, q, block]() mutable {
    for (int r = 0; r < world; ++r) {
      dequantize(all.narrow(0, r * bytes, bytes), out.narrow(0, r * n, n), q, block);
    }
  });
}

}  // namespace dtrain::detail

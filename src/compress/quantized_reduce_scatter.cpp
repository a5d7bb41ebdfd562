#include "compress/quantized_reduce_scatter.h"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include <fmt/format.h>

#include "compress/quantize.h"
#include "dtrain/errors.h"

namespace dtrain::detail {

int exchange_rounds(int world) { return world % 2 == 0 ? world - 1 : world; }

int exchange_partner(int rank, int world, int round) {
  // Circle method over m (even) slots: slot m - 1 is fixed, the others rotate. In round k,
  // slot r < m - 1 meets (2k - r) mod (m - 1), and slot k meets m - 1. An odd world has a
  // dummy slot m - 1 == world: whoever meets it rests.
  const int m = world % 2 == 0 ? world : world + 1;
  int partner = 0;
  if (rank == m - 1) {
    partner = round;
  } else {
    partner = ((2 * round - rank) % (m - 1) + (m - 1)) % (m - 1);
    if (partner == rank) partner = m - 1;
  }
  return partner >= world ? -1 : partner;
}

WorkPtr quantized_reduce_scatter(Communicator& comm, at::Tensor output, const at::Tensor& input,
                                 Quantization q, int64_t block, int64_t* wire_bytes) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const ErrorContext ctx{rank, world, "quantized_reduce_scatter", -1};
  const int64_t n = output.numel();
  if (input.numel() != n * world || input.dim() != 1 || output.dim() != 1) {
    throw InvalidArgument(ctx, fmt::format("input has {} elements, output {}: 1-D tensors of "
                                           "{} ranks x output elements expected",
                                           input.numel(), n, world));
  }
  if (q == Quantization::kNone) {
    throw InvalidArgument(ctx, "nothing to quantise: Quantization::kNone");
  }
  const int64_t bytes = quantized_bytes(q, n, block);
  if (wire_bytes != nullptr) *wire_bytes = bytes * world;
  const at::Tensor in = input.contiguous();
  const auto byte_options = in.options().dtype(at::kByte);
  at::Tensor sent = at::empty({bytes * world}, byte_options);
  at::Tensor received = at::empty({bytes * world}, byte_options);
  for (int p = 0; p < world; ++p) {
    if (p != rank) quantize(in.narrow(0, p * n, n), sent.narrow(0, p * bytes, bytes), q, block);
  }
  std::vector<WorkPtr> works;
  for (int round = 0; round < exchange_rounds(world); ++round) {
    const int p = exchange_partner(rank, world, round);
    if (p < 0) continue;
    at::Tensor to = sent.narrow(0, p * bytes, bytes);
    at::Tensor from = received.narrow(0, p * bytes, bytes);
    if (rank < p) {
      works.push_back(comm.send(to, p));
      works.push_back(comm.recv(from, p));
    } else {
      works.push_back(comm.recv(from, p));
      works.push_back(comm.send(to, p));
    }
  }
  at::Tensor out = output.variable_data();
  auto finish = [works, out, in, sent, received, bytes, world, rank, n, q, block]() mutable {
    for (auto& w : works) w->wait();
    const auto f32 = in.options().dtype(at::kFloat);
    at::Tensor sum = at::zeros({n}, f32);
    at::Tensor one = at::empty({n}, f32);
    for (int p = 0; p < world; ++p) {
      if (p == rank) {
        sum.add_(in.narrow(0, p * n, n).to(at::kFloat));
      } else {
        dequantize(received.narrow(0, p * bytes, bytes), one, q, block);
        sum.add_(one);
      }
    }
    out.copy_(sum.div_(world));
  };
  if (works.empty()) {
    // One rank: nothing crosses the wire.
    finish();
    return then(comm.barrier(), [] {});
  }
  WorkPtr last = works.back();
  return then(std::move(last), std::move(finish));
}

}  // namespace dtrain::detail

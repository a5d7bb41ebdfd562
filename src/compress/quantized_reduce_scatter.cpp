#include "compress/quantized_reduce_scatter.h"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/control_plane.h"
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

std::vector<WorkPtr> swap_with_peers(Communicator& comm, const std::vector<int>& peers, int me,
                                     const at::Tensor& sent, const at::Tensor& received,
                                     int64_t bytes) {
  const int count = static_cast<int>(peers.size());
  std::vector<WorkPtr> works;
  for (int round = 0; round < exchange_rounds(count); ++round) {
    const int p = exchange_partner(me, count, round);
    if (p < 0) continue;
    at::Tensor to = sent.narrow(0, p * bytes, bytes);
    at::Tensor from = received.narrow(0, p * bytes, bytes);
    // The lower of a pair sends first, so ranks whose point-to-point calls run one after
    // another (NCCL) cannot deadlock.
    if (me < p) {
      works.push_back(comm.send(to, peers[p]));
      works.push_back(comm.recv(from, peers[p]));
    } else {
      works.push_back(comm.recv(from, peers[p]));
      works.push_back(comm.send(to, peers[p]));
    }
  }
  return works;
}

namespace {

// The exchange both forms share, among `peers` (ranks of `comm`; this rank is peers[me]):
// chunks[p] (n values) goes to peers[p] quantised; the result is chunks[me] exactly plus
// every received chunk dequantised into fp32, in peer order, divided by `divisor`, written
// to `out`. Returns this rank's quantised bytes (all chunks, its own included).
WorkPtr exchange(Communicator& comm, const std::vector<int>& peers, int me, at::Tensor chunks,
                 int64_t divisor, Quantization q, int64_t block, at::Tensor out) {
  const int count = static_cast<int>(peers.size());
  const int64_t n = out.numel();
  const int64_t bytes = quantized_bytes(q, n, block);
  const auto byte_options = chunks.options().dtype(at::kByte);
  at::Tensor sent = at::empty({bytes * count}, byte_options);
  at::Tensor received = at::empty({bytes * count}, byte_options);
  for (int p = 0; p < count; ++p) {
    if (p != me) quantize(chunks.narrow(0, p * n, n), sent.narrow(0, p * bytes, bytes), q, block);
  }
  std::vector<WorkPtr> works = swap_with_peers(comm, peers, me, sent, received, bytes);
  auto finish = [works, out, chunks, sent, received, bytes, count, me, n, divisor, q,
                 block]() mutable {
    for (auto& w : works) w->wait();
    const auto f32 = chunks.options().dtype(at::kFloat);
    at::Tensor sum = at::zeros({n}, f32);
    at::Tensor one = at::empty({n}, f32);
    for (int p = 0; p < count; ++p) {
      if (p == me) {
        sum.add_(chunks.narrow(0, p * n, n).to(at::kFloat));
      } else {
        dequantize(received.narrow(0, p * bytes, bytes), one, q, block);
        sum.add_(one);
      }
    }
    out.copy_(sum.div_(divisor));
  };
  if (works.empty()) {
    // One peer: nothing crosses the wire.
    finish();
    return then(comm.barrier(), [] {});
  }
  WorkPtr last = works.back();
  return then(std::move(last), std::move(finish));
}

void check_shapes(const ErrorContext& ctx, const at::Tensor& output, const at::Tensor& input,
                  int world, Quantization q) {
  if (input.numel() != output.numel() * world || input.dim() != 1 || output.dim() != 1) {
    throw InvalidArgument(ctx, fmt::format("input has {} elements, output {}: 1-D tensors of "
                                           "{} ranks x output elements expected",
                                           input.numel(), output.numel(), world));
  }
  if (q == Quantization::kNone) {
    throw InvalidArgument(ctx, "nothing to quantise: Quantization::kNone");
  }
}

}  // namespace

WorkPtr quantized_reduce_scatter(Communicator& comm, at::Tensor output, const at::Tensor& input,
                                 Quantization q, int64_t block, int64_t* wire_bytes) {
  const int world = comm.world_size();
  check_shapes(ErrorContext{comm.rank(), world, "quantized_reduce_scatter", -1}, output, input,
               world, q);
  if (wire_bytes != nullptr) *wire_bytes = quantized_bytes(q, output.numel(), block) * world;
  std::vector<int> peers(world);
  for (int p = 0; p < world; ++p) peers[p] = p;
  return exchange(comm, peers, comm.rank(), input.contiguous(), world, q, block,
                  output.variable_data());
}

void check_host_layout(Communicator& comm, Communicator& host) {
  const int world = comm.world_size(), local = host.world_size();
  const ErrorContext ctx{comm.rank(), world, "check_host_layout", -1};
  if (local < 1 || world % local != 0) {
    throw InvalidArgument(ctx, fmt::format("the host group's {} ranks must divide the {} of the "
                                           "group it reduces over",
                                           local, world));
  }
  const auto ranks = ControlPlane(host).all_gather(std::vector<int64_t>{comm.rank()});
  const int64_t first = comm.rank() / local * local;
  for (int i = 0; i < local; ++i) {
    if (ranks[i] != first + i) {
      throw InvalidArgument(
          ctx, fmt::format("the host group must hold ranks {}..{} of the group it reduces over, "
                           "in order (make_host_group's layout); its rank {} is rank {}",
                           first, first + local - 1, i, ranks[i]));
    }
  }
}

WorkPtr hierarchical_quantized_reduce_scatter(Communicator& comm, Communicator& host,
                                              at::Tensor output, const at::Tensor& input,
                                              Quantization q, int64_t block, int64_t* wire_bytes) {
  const int world = comm.world_size(), local = host.world_size();
  const ErrorContext ctx{comm.rank(), world, "hierarchical_quantized_reduce_scatter", -1};
  check_shapes(ctx, output, input, world, q);
  if (local < 1 || world % local != 0) {
    throw InvalidArgument(ctx,
                          fmt::format("the host group's {} ranks must divide {}", local, world));
  }
  const int hosts = world / local;
  const int64_t n = output.numel();
  // Inside the host, in fp32: local rank i gets its host's sum of chunks i, L + i, 2L + i, ...
  // (the host's reduce-scatter takes L pieces of H chunks each: the input as [L][H][n]).
  const at::Tensor by_local =
      input.to(at::kFloat).view({hosts, local, n}).transpose(0, 1).contiguous().view({-1});
  at::Tensor host_sums = at::empty({hosts * n}, by_local.options());
  WorkPtr inside = host.reduce_scatter(host_sums, by_local, ReduceOp::kSum);
  inside->wait();
  if (wire_bytes != nullptr) {
    *wire_bytes = static_cast<int64_t>(by_local.nbytes()) + quantized_bytes(q, n, block) * hosts;
  }
  if (hosts == 1) {
    // One host: nothing crosses hosts.
    return then(std::move(inside),
                [out = output.variable_data(), host_sums, world] { out.copy_(host_sums / world); });
  }
  // Between hosts: rank gL + i owns chunk gL + i.
  const int i = comm.rank() % local;
  std::vector<int> peers(hosts);
  for (int g = 0; g < hosts; ++g) peers[g] = g * local + i;
  return exchange(comm, peers, comm.rank() / local, host_sums, world, q, block,
                  output.variable_data());
}

}  // namespace dtrain::detail

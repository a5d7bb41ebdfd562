#include "compress/hierarchical_all_reduce.h"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "compress/quantize.h"
#include "compress/quantized_reduce_scatter.h"

namespace dtrain::detail {

WorkPtr hierarchical_quantized_all_reduce(Communicator& comm, Communicator& host, at::Tensor tensor,
                                          Quantization q, int64_t block) {
  const int world = comm.world_size(), local = host.world_size(), hosts = world / local;
  const int64_t n = tensor.numel();
  const int64_t chunk = std::max<int64_t>(1, (n + world - 1) / world);
  at::Tensor padded = at::zeros({chunk * world}, tensor.options().dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(tensor.view({-1}));
  at::Tensor mine = at::empty({chunk}, padded.options());
  WorkPtr reduced =
      hierarchical_quantized_reduce_scatter(comm, host, mine, padded, q, block, nullptr);
  Communicator* world_comm = &comm;
  Communicator* host_comm = &host;
  auto gather = [world_comm, host_comm, tensor, mine, world, local, hosts, chunk, n, q,
                 block]() mutable {
    // Between hosts: the owners of chunks gL + i (one per host) swap their averages.
    const int64_t bytes = quantized_bytes(q, chunk, block);
    const auto byte_options = mine.options().dtype(at::kByte);
    at::Tensor quantised = at::empty({bytes}, byte_options);
    quantize(mine, quantised, q, block);
    const int me = world_comm->rank() / local, i = world_comm->rank() % local;
    std::vector<int> peers(hosts);
    for (int g = 0; g < hosts; ++g) peers[g] = g * local + i;
    at::Tensor sent = quantised.repeat({hosts});
    at::Tensor received = at::empty({bytes * hosts}, byte_options);
    received.narrow(0, me * bytes, bytes).copy_(quantised);
    for (auto& w : swap_with_peers(*world_comm, peers, me, sent, received, bytes)) w->wait();
    // This rank's chunks gL + i, g = 0..H-1, dequantised (its own too, as its peers see it).
    at::Tensor by_host = at::empty({hosts * chunk}, mine.options());
    for (int g = 0; g < hosts; ++g) {
      dequantize(received.narrow(0, g * bytes, bytes), by_host.narrow(0, g * chunk, chunk), q,
                 block);
    }
    // Inside the host, in fp32: [L][H][chunk] back into rank order [H][L][chunk].
    at::Tensor all = at::empty({local * hosts * chunk}, mine.options());
    host_comm->all_gather(all, by_host)->wait();
    at::Tensor ordered = all.view({local, hosts, chunk}).transpose(0, 1).reshape({-1});
    tensor.view({-1}).copy_(ordered.narrow(0, 0, n));
  };
  return then(std::move(reduced), std::move(gather));
}

}  // namespace dtrain::detail

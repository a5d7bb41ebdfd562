#include "comm/gloo/reduce_scatter_ring.h"

#include <ATen/ATen.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace dtrain::gloo_backend {

at::Tensor RingScratch::get(int slot, int64_t numel, const at::Tensor& like) {
  at::Tensor& buf = bytes_[slot];
  const int64_t bytes = numel * static_cast<int64_t>(like.element_size());
  if (!buf.defined() || static_cast<int64_t>(buf.nbytes()) < bytes) {
    buf = at::empty({bytes}, like.options().dtype(at::kByte));
  }
  return at::from_blob(buf.data_ptr(), {numel}, like.options());
}

void reduce_scatter_ring(gloo::Context& context, const at::Tensor& output, const at::Tensor& input,
                         reduce::ReduceFn fn, uint64_t slot, size_t max_segment_bytes,
                         std::chrono::milliseconds timeout, RingScratch& scratch) {
  const int64_t n = output.numel();
  const size_t elem = input.element_size();
  const size_t bytes = static_cast<size_t>(n) * elem;
  const int N = context.size;
  const int rank = context.rank;
  const char* in = static_cast<const char*>(input.data_ptr());
  auto chunk = [&](int i) { return in + static_cast<size_t>((i % N + N) % N) * bytes; };
  if (N == 1 || n == 0) {
    if (bytes > 0) std::memcpy(output.data_ptr(), in, bytes);
    return;
  }
  // At step s rank r sends its partial sum of chunk (r - s - 1) to r + 1 and receives the
  // partial sum of chunk (r - s - 2) from r - 1; after N - 1 steps it holds the full
  // reduction of chunk r. Chunks move in segments, pipelined: segment j is reduced and sent
  // on while later segments are still arriving, so reduction overlaps with transfer.
  const int64_t seg = std::clamp<int64_t>(static_cast<int64_t>(max_segment_bytes / elem), 1, n);
  const int64_t num_segs = (n + seg - 1) / seg;
  auto seg_offset = [&](int64_t j) { return static_cast<size_t>(j * seg) * elem; };
  auto seg_bytes = [&](int64_t j) {
    return static_cast<size_t>(std::min(seg, n - j * seg)) * elem;
  };
  // Two receive buffers, so that step s + 1's segments can land while step s reduces.
  at::Tensor acc = scratch.get(0, n, input);
  at::Tensor recv[2] = {scratch.get(1, n, input), scratch.get(2, n, input)};
  auto acc_buf = context.createUnboundBuffer(acc.data_ptr(), bytes);
  std::unique_ptr<gloo::transport::UnboundBuffer> recv_buf[2] = {
      context.createUnboundBuffer(recv[0].data_ptr(), bytes),
      context.createUnboundBuffer(recv[1].data_ptr(), bytes)};
  auto in_buf = context.createUnboundBuffer(const_cast<char*>(in), bytes * N);
  const int right = (rank + 1) % N;
  const int left = (rank - 1 + N) % N;
  // One slot for the whole call: a pair delivers messages of one slot in order, and
  // receives are matched in the order they were posted.
  auto post_recvs = [&](int step) {
    for (int64_t j = 0; j < num_segs; ++j) {
      recv_buf[step % 2]->recv(left, slot, seg_offset(j), seg_bytes(j));
    }
  };
  const size_t first = static_cast<size_t>(chunk(rank - 1) - in);
  for (int64_t j = 0; j < num_segs; ++j)
    in_buf->send(right, slot, first + seg_offset(j), seg_bytes(j));
  post_recvs(0);
  int64_t acc_sends = 0;  // posted and not yet waited for, completed in posting order
  for (int s = 0; s < N - 1; ++s) {
    // recv[(s + 1) % 2] was last read by step s - 1, which has finished.
    if (s + 1 < N - 1) post_recvs(s + 1);
    const bool last = s == N - 2;
    char* dst = static_cast<char*>(last ? output.data_ptr() : acc.data_ptr());
    const char* local = chunk(rank - s - 2);
    const char* got = static_cast<const char*>(recv[s % 2].data_ptr());
    for (int64_t j = 0; j < num_segs; ++j) {
      recv_buf[s % 2]->waitRecv(timeout);
      // Step s - 1 sent acc's segment j: it must have left before it is overwritten.
      if (!last && s > 0) {
        acc_buf->waitSend(timeout);
        --acc_sends;
      }
      fn(dst + seg_offset(j), got + seg_offset(j), local + seg_offset(j),
         static_cast<size_t>(seg_bytes(j) / elem));
      if (!last) {
        acc_buf->send(right, slot, seg_offset(j), seg_bytes(j));
        ++acc_sends;
      }
    }
  }
  for (int64_t j = 0; j < num_segs; ++j) in_buf->waitSend(timeout);
  for (; acc_sends > 0; --acc_sends) acc_buf->waitSend(timeout);
}

}  // namespace dtrain::gloo_backend

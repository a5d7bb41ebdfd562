#include "comm/gloo/gloo_communicator.h"

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "comm/gloo/reduce_ops.h"
#include "comm/net/address.h"

namespace dtrain::gloo_backend {
namespace {

// Slot prefixes for transfers dtrain issues itself; Gloo's own collectives use 0x01-0x08.
constexpr uint8_t kReduceScatterSlotPrefix = 0x20;
constexpr uint8_t kP2PSlotPrefix = 0x21;

// Exposes a dtrain::Store to Gloo's rendezvous, with dtrain's timeout on every wait.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<dtrain::Store> store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes b = store_->get(key, timeout_);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<dtrain::Store> store_;
  std::chrono::milliseconds timeout_;
};

std::exception_ptr translate(const ErrorContext& ctx, const std::exception& e) {
  std::string msg = e.what();
  if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  if (msg.find("Timed out") != std::string::npos || msg.find("timed out") != std::string::npos ||
      msg.find("Timeout") != std::string::npos) {
    return std::make_exception_ptr(TimeoutError(ctx, msg));
  }
  return std::make_exception_ptr(CommError(ctx, msg));
}

template <size_t N>
struct Storage;
template <>
struct Storage<1> {
  using type = uint8_t;
};
template <>
struct Storage<2> {
  using type = uint16_t;
};
template <>
struct Storage<4> {
  using type = uint32_t;
};
template <>
struct Storage<8> {
  using type = uint64_t;
};

// Gloo's options are templated on the element type only to learn its size; dispatch on
// the size so that bfloat16 (unknown to Gloo) goes through the same path.
template <typename F>
void with_element_type(size_t element_size, F&& f) {
  switch (element_size) {
    case 1:
      f(typename Storage<1>::type{});
      return;
    case 2:
      f(typename Storage<2>::type{});
      return;
    case 4:
      f(typename Storage<4>::type{});
      return;
    case 8:
      f(typename Storage<8>::type{});
      return;
    default:
      throw InvalidArgument(fmt::format("unsupported element size {}", element_size));
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(std::shared_ptr<Store> store, int rank, int world_size,
                                   const CommunicatorOptions& options)
    : rank_(rank), world_size_(world_size), options_(options), store_(std::move(store)) {
  const ErrorContext ctx = context("connect", -1);
  gloo::transport::tcp::attr attr;
  try {
    attr.hostname = net::choose_listen_address(options, *store_);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(ctx, e.cause());
  }
  try {
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto gloo_context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    gloo_context->setTimeout(options.timeout);
    StoreAdapter adapter(make_prefix_store("dtrain/gloo/" + options.name, store_), options.timeout);
    gloo_context->connectFullMesh(adapter, device);
    context_ = std::move(gloo_context);
  } catch (const Error& e) {
    if (dynamic_cast<const TimeoutError*>(&e)) {
      throw TimeoutError(ctx, fmt::format("not every rank joined within {} ms ({})",
                                          options.timeout.count(), e.what()));
    }
    throw CommError(ctx, e.what());
  } catch (const std::exception& e) {
    std::rethrow_exception(translate(ctx, e));
  }
  p2p_waiter_ = std::make_unique<detail::SerialExecutor>();
  executor_ = std::make_unique<detail::SerialExecutor>();
}

GlooCommunicator::~GlooCommunicator() {
  executor_.reset();
  p2p_waiter_.reset();
}

ErrorContext GlooCommunicator::context(const char* op, int64_t seq) const {
  return ErrorContext{rank_, world_size_, op, seq};
}

std::chrono::milliseconds GlooCommunicator::call_timeout(const CallOptions& options) const {
  return options.timeout.count() > 0 ? options.timeout : options_.timeout;
}

void GlooCommunicator::check_tensor(const at::Tensor& t, const char* op, const char* what) const {
  auto fail = [&](const std::string& why) {
    throw InvalidArgument(context(op, -1), fmt::format("{}: {}", what, why));
  };
  if (!t.defined()) fail("undefined tensor");
  if (!t.device().is_cpu()) fail(fmt::format("Gloo needs CPU tensors, got {}", t.device().str()));
  if (t.layout() != c10::kStrided) fail("must be a dense (strided) tensor");
  if (!t.is_contiguous()) fail("must be contiguous");
  if (!is_supported_dtype(t.scalar_type()))
    fail(fmt::format("dtype {} is not supported", c10::toString(t.scalar_type())));
}

void GlooCommunicator::check_peer(int peer, const char* op) const {
  if (peer < 0 || peer >= world_size_ || peer == rank_) {
    throw InvalidArgument(
        context(op, -1),
        fmt::format("peer rank {} is not another rank of [0, {})", peer, world_size_));
  }
}

std::exception_ptr GlooCommunicator::run_guarded(const ErrorContext& ctx,
                                                 const std::function<void()>& body) {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (broken_) {
      try {
        std::rethrow_exception(broken_);
      } catch (const Error& first) {
        return std::make_exception_ptr(CommError(
            ctx, fmt::format("communicator failed earlier, at {} #{}: {}", first.context().op,
                             first.context().sequence, first.cause())));
      }
    }
  }
  std::exception_ptr error;
  try {
    body();
    return nullptr;
  } catch (const Error& e) {
    error = std::make_exception_ptr(CommError(ctx, e.cause()));
    if (dynamic_cast<const TimeoutError*>(&e))
      error = std::make_exception_ptr(TimeoutError(ctx, e.cause()));
  } catch (const std::exception& e) {
    error = translate(ctx, e);
  }
  std::lock_guard<std::mutex> lock(broken_mu_);
  if (!broken_) broken_ = error;
  return error;
}

WorkPtr GlooCommunicator::enqueue(const char* op, std::vector<at::Tensor> tensors,
                                  const CallOptions& options, Body body) {
  const uint64_t seq = seq_.fetch_add(1);
  const ErrorContext ctx = context(op, static_cast<int64_t>(seq));
  const auto timeout = call_timeout(options);
  // The call itself is bounded by `timeout` once it starts; the margin covers queueing.
  auto work = std::make_shared<detail::CpuWork>(seq, op, ctx, 2 * timeout + std::chrono::seconds(1),
                                                std::move(tensors));
  executor_->submit([this, work, ctx, timeout, seq, body = std::move(body)] {
    work->finish(run_guarded(ctx, [&] { body(timeout, seq); }));
  });
  return work;
}

WorkPtr GlooCommunicator::all_reduce(at::Tensor tensor, ReduceOp op, const CallOptions& options) {
  check_tensor(tensor, "all_reduce", "tensor");
  ReduceFn fn;
  try {
    fn = reduce_fn(tensor.scalar_type(), op);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(context("all_reduce", -1), e.cause());
  }
  return enqueue("all_reduce", {tensor}, options,
                 [this, tensor, op, fn](std::chrono::milliseconds timeout, uint64_t seq) mutable {
                   const size_t n = static_cast<size_t>(tensor.numel());
                   if (n == 0 || world_size_ == 1) return;
                   with_element_type(tensor.element_size(), [&](auto tag) {
                     using T = decltype(tag);
                     gloo::AllreduceOptions o(context_);
                     o.setOutput<T>(static_cast<T*>(tensor.data_ptr()), n);
                     o.setReduceFunction(
                         [fn](void* c, const void* a, const void* b, size_t k) { fn(c, a, b, k); });
                     o.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
                     o.setMaxSegmentSize(options_.gloo_max_segment_bytes);
                     o.setTag(static_cast<uint32_t>(seq));
                     o.setTimeout(timeout);
                     gloo::allreduce(o);
                   });
                   if (op == ReduceOp::kAvg) tensor.div_(world_size_);
                 });
}

WorkPtr GlooCommunicator::broadcast(at::Tensor tensor, int root, const CallOptions& options) {
  check_tensor(tensor, "broadcast", "tensor");
  if (root < 0 || root >= world_size_) {
    throw InvalidArgument(context("broadcast", -1),
                          fmt::format("root {} is not a rank of [0, {})", root, world_size_));
  }
  return enqueue("broadcast", {tensor}, options,
                 [this, tensor, root](std::chrono::milliseconds timeout, uint64_t seq) mutable {
                   const size_t n = static_cast<size_t>(tensor.numel());
                   if (n == 0 || world_size_ == 1) return;
                   with_element_type(tensor.element_size(), [&](auto tag) {
                     using T = decltype(tag);
                     gloo::BroadcastOptions o(context_);
                     o.setOutput<T>(static_cast<T*>(tensor.data_ptr()), n);
                     o.setRoot(root);
                     o.setTag(static_cast<uint32_t>(seq));
                     o.setTimeout(timeout);
                     gloo::broadcast(o);
                   });
                 });
}

WorkPtr GlooCommunicator::all_gather(at::Tensor output, at::Tensor input,
                                     const CallOptions& options) {
  check_tensor(output, "all_gather", "output");
  check_tensor(input, "all_gather", "input");
  if (output.scalar_type() != input.scalar_type() ||
      output.numel() != input.numel() * world_size_) {
    throw InvalidArgument(
        context("all_gather", -1),
        fmt::format("output must have world_size * input.numel() = {} elements of {}, got {} of {}",
                    input.numel() * world_size_, c10::toString(input.scalar_type()), output.numel(),
                    c10::toString(output.scalar_type())));
  }
  return enqueue("all_gather", {output, input}, options,
                 [this, output, input](std::chrono::milliseconds timeout, uint64_t seq) mutable {
                   const size_t n = static_cast<size_t>(input.numel());
                   const size_t bytes = n * input.element_size();
                   auto* own = static_cast<char*>(output.data_ptr()) + rank_ * bytes;
                   // The input may already be this rank's slice of the output (FSDP does that).
                   if (own != input.data_ptr() && bytes > 0)
                     std::memcpy(own, input.data_ptr(), bytes);
                   if (n == 0 || world_size_ == 1) return;
                   with_element_type(input.element_size(), [&](auto tag) {
                     using T = decltype(tag);
                     gloo::AllgatherOptions o(context_);
                     o.setOutput<T>(static_cast<T*>(output.data_ptr()), n * world_size_);
                     o.setTag(static_cast<uint32_t>(seq));
                     o.setTimeout(timeout);
                     gloo::allgather(o);
                   });
                 });
}

WorkPtr GlooCommunicator::reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                                         const CallOptions& options) {
  check_tensor(output, "reduce_scatter", "output");
  check_tensor(input, "reduce_scatter", "input");
  if (output.scalar_type() != input.scalar_type() ||
      input.numel() != output.numel() * world_size_) {
    throw InvalidArgument(
        context("reduce_scatter", -1),
        fmt::format("input must have world_size * output.numel() = {} elements of {}, got {} of "
                    "{} (pad with dtrain::padded_size)",
                    output.numel() * world_size_, c10::toString(output.scalar_type()),
                    input.numel(), c10::toString(input.scalar_type())));
  }
  ReduceFn fn;
  try {
    fn = reduce_fn(input.scalar_type(), op);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(context("reduce_scatter", -1), e.cause());
  }
  return enqueue(
      "reduce_scatter", {output, input}, options,
      [this, output, input, op, fn](std::chrono::milliseconds timeout, uint64_t seq) mutable {
        const int64_t n = output.numel();
        const size_t bytes = static_cast<size_t>(n) * input.element_size();
        const int N = world_size_;
        const char* in = static_cast<const char*>(input.data_ptr());
        auto chunk = [&](int i) { return in + static_cast<size_t>((i % N + N) % N) * bytes; };
        if (N == 1 || n == 0) {
          if (bytes > 0) std::memcpy(output.data_ptr(), in, bytes);
          return;
        }
        // Ring: at step s rank r sends its partial sum of chunk (r - s - 1) to r + 1 and
        // receives the partial sum of chunk (r - s - 2) from r - 1; after N - 1 steps it
        // holds the full reduction of chunk r. Chunks move in segments of at most
        // gloo_max_segment_bytes, pipelined: segment j is reduced and sent on while later
        // segments are still arriving, so reduction overlaps with transfer.
        const size_t elem = input.element_size();
        const int64_t seg =
            std::clamp<int64_t>(static_cast<int64_t>(options_.gloo_max_segment_bytes / elem), 1, n);
        const int64_t num_segs = (n + seg - 1) / seg;
        auto seg_offset = [&](int64_t j) { return static_cast<size_t>(j * seg) * elem; };
        auto seg_bytes = [&](int64_t j) {
          return static_cast<size_t>(std::min(seg, n - j * seg)) * elem;
        };
        // Scratch reused across calls (only the executor thread touches it): fresh chunk-sized
        // buffers on every call cost more in page faults than the reduction itself. Two
        // receive buffers, so that step s + 1's segments can land while step s reduces.
        at::Tensor acc = scratch(0, n, input);
        at::Tensor recv[2] = {scratch(1, n, input), scratch(2, n, input)};
        auto acc_buf = context_->createUnboundBuffer(acc.data_ptr(), bytes);
        std::unique_ptr<gloo::transport::UnboundBuffer> recv_buf[2] = {
            context_->createUnboundBuffer(recv[0].data_ptr(), bytes),
            context_->createUnboundBuffer(recv[1].data_ptr(), bytes)};
        auto in_buf = context_->createUnboundBuffer(const_cast<char*>(in), bytes * N);
        const int right = (rank_ + 1) % N;
        const int left = (rank_ - 1 + N) % N;
        // One slot for the whole call: a pair delivers messages of one slot in order, and
        // receives are matched in the order they were posted.
        const uint64_t slot =
            gloo::Slot::build(kReduceScatterSlotPrefix, static_cast<uint32_t>(seq));
        auto post_recvs = [&](int step) {
          for (int64_t j = 0; j < num_segs; ++j) {
            recv_buf[step % 2]->recv(left, slot, seg_offset(j), seg_bytes(j));
          }
        };
        const size_t first = static_cast<size_t>(chunk(rank_ - 1) - in);
        for (int64_t j = 0; j < num_segs; ++j) {
          in_buf->send(right, slot, first + seg_offset(j), seg_bytes(j));
        }
        post_recvs(0);
        int64_t acc_sends = 0;  // posted and not yet waited for, completed in posting order
        for (int s = 0; s < N - 1; ++s) {
          // recv[(s + 1) % 2] was last read by step s - 1, which has finished.
          if (s + 1 < N - 1) post_recvs(s + 1);
          const bool last = s == N - 2;
          char* dst = static_cast<char*>(last ? output.data_ptr() : acc.data_ptr());
          const char* local = chunk(rank_ - s - 2);
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
        if (op == ReduceOp::kAvg) output.div_(N);
      });
}

at::Tensor GlooCommunicator::scratch(int slot, int64_t numel, const at::Tensor& like) {
  at::Tensor& buf = scratch_[slot];
  const int64_t bytes = numel * static_cast<int64_t>(like.element_size());
  if (!buf.defined() || static_cast<int64_t>(buf.nbytes()) < bytes) {
    buf = at::empty({bytes}, like.options().dtype(at::kByte));
  }
  // A typed view of the first `numel` elements of the byte buffer.
  return at::from_blob(buf.data_ptr(), {numel}, like.options());
}

WorkPtr GlooCommunicator::barrier(const CallOptions& options) {
  return enqueue("barrier", {}, options, [this](std::chrono::milliseconds timeout, uint64_t seq) {
    if (world_size_ == 1) return;
    gloo::BarrierOptions o(context_);
    o.setTag(static_cast<uint32_t>(seq));
    o.setTimeout(timeout);
    gloo::barrier(o);
  });
}

WorkPtr GlooCommunicator::enqueue_p2p(const char* op, at::Tensor tensor, int peer, uint32_t tag,
                                      const CallOptions& options, bool is_send) {
  check_tensor(tensor, op, "tensor");
  check_peer(peer, op);
  const uint64_t seq = p2p_seq_.fetch_add(1);
  const ErrorContext ctx = context(op, static_cast<int64_t>(seq));
  const auto timeout = call_timeout(options);
  auto work = std::make_shared<detail::CpuWork>(seq, op, ctx, 2 * timeout + std::chrono::seconds(1),
                                                std::vector<at::Tensor>{tensor});
  executor_->submit([this, work, ctx, timeout, tensor, peer, tag, is_send] {
    std::shared_ptr<gloo::transport::UnboundBuffer> buf;
    auto error = run_guarded(ctx, [&] {
      const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
      buf = context_->createUnboundBuffer(tensor.data_ptr(), bytes);
      const uint64_t slot = gloo::Slot::build(kP2PSlotPrefix, tag);
      if (is_send) {
        buf->send(peer, slot, 0, bytes);
      } else {
        buf->recv(peer, slot, 0, bytes);
      }
    });
    if (error) {
      work->finish(error);
      return;
    }
    p2p_waiter_->submit([this, work, ctx, timeout, buf, is_send] {
      work->finish(run_guarded(ctx, [&] {
        if (is_send) {
          buf->waitSend(timeout);
        } else {
          buf->waitRecv(timeout);
        }
      }));
    });
  });
  return work;
}

WorkPtr GlooCommunicator::send(at::Tensor tensor, int dst, uint32_t tag,
                               const CallOptions& options) {
  return enqueue_p2p("send", std::move(tensor), dst, tag, options, true);
}

WorkPtr GlooCommunicator::recv(at::Tensor tensor, int src, uint32_t tag,
                               const CallOptions& options) {
  return enqueue_p2p("recv", std::move(tensor), src, tag, options, false);
}

}  // namespace dtrain::gloo_backend

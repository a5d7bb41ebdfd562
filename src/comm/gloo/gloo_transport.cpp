#include "comm/gloo/gloo_transport.h"

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "comm/cpu_work.h"
#include "comm/gloo/bounded_wait.h"
#include "comm/gloo/header_exchange.h"
#include "comm/gloo/reduce_scatter_ring.h"
#include "comm/gloo/wire_bytes.h"
#include "comm/net/address.h"
#include "comm/reduce/reduce_ops.h"
#include "compat/gloo.h"

namespace dtrain::gloo_backend {
namespace {

// Slot prefixes for transfers dtrain issues itself; Gloo's own collectives use 0x01-0x08.
constexpr uint8_t kReduceScatterSlotPrefix = 0x20;
constexpr uint8_t kP2PSlotPrefix = 0x21;
constexpr uint8_t kHeaderSlotPrefix = 0x22;

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

// Point-to-point messages match on tag, dtype and byte count: a 24-bit digest of the last two
// fills the low bits of the slot, which Gloo leaves to the caller. A receive of another size
// or dtype then never matches and times out naming the cause, instead of aborting inside
// Gloo's thread (a message larger than its receive) or reinterpreting the bytes.
uint64_t p2p_slot(uint32_t tag, const at::Tensor& t) {
  uint64_t h = static_cast<uint64_t>(t.numel()) * 0x9E3779B97F4A7C15ull;
  h ^= (static_cast<uint64_t>(t.scalar_type()) + 1) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  return static_cast<uint64_t>(gloo::Slot::build(kP2PSlotPrefix, tag)) | (h & 0xFFFFFF);
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

using detail::Collective;
using detail::CollectiveOp;
using detail::CpuWork;
using detail::PointToPoint;
using detail::WireKind;

class GlooTransport final : public detail::CollectiveEngine {
 public:
  GlooTransport(std::shared_ptr<Store> store, int rank, int world_size,
                const CommunicatorOptions& options, std::shared_ptr<detail::StickyFailure> failure,
                detail::WireTally wire);
  ~GlooTransport() override;

  const char* name() const override { return "gloo"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void check_tensor(const at::Tensor& t, const ErrorContext& ctx, const char* what) const override;
  void check_call(const Collective& call) const override;
  WorkPtr start(Collective call) override;
  WorkPtr start(PointToPoint call) override;

 private:
  // Executor thread: the header exchange, then the data. Throws on failure.
  void run(const Collective& call);
  void all_reduce(const Collective& call, std::chrono::milliseconds timeout);
  void broadcast(const Collective& call, std::chrono::milliseconds timeout);
  void all_gather(const Collective& call, std::chrono::milliseconds timeout);
  void reduce_scatter(const Collective& call, std::chrono::milliseconds timeout);
  void barrier(const Collective& call, std::chrono::milliseconds timeout);

  const int rank_;
  const int world_size_;
  const CommunicatorOptions options_;
  // Kept for the communicator's lifetime: on rank 0 it may host the TCP store server that
  // slower ranks still need to finish their own rendezvous.
  std::shared_ptr<Store> store_;
  std::shared_ptr<detail::StickyFailure> failure_;
  const detail::WireTally wire_;
  std::shared_ptr<gloo::Context> context_;
  // Executor thread only.
  std::unique_ptr<HeaderExchange> headers_;
  RingScratch scratch_;

  // Declared last: destroyed first, so queued calls finish while members above live.
  std::unique_ptr<detail::SerialExecutor> p2p_waiter_;
  std::unique_ptr<detail::SerialExecutor> executor_;
};

GlooTransport::GlooTransport(std::shared_ptr<Store> store, int rank, int world_size,
                             const CommunicatorOptions& options,
                             std::shared_ptr<detail::StickyFailure> failure, detail::WireTally wire)
    : rank_(rank),
      world_size_(world_size),
      options_(options),
      store_(std::move(store)),
      failure_(std::move(failure)),
      wire_(std::move(wire)) {
  const ErrorContext ctx{rank, world_size, "connect", -1};
  gloo::transport::tcp::attr attr;
  try {
    attr.hostname = net::choose_listen_address(options.interface, options.hostname, *store_);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(ctx, e.cause());
  }
  try {
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto gloo_context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    gloo_context->setTimeout(options.timeout);
    auto adapter = std::make_shared<StoreAdapter>(
        make_prefix_store("dtrain/gloo/" + options.name, store_), options.timeout);
    // Each pair's connect is bounded by the context's timeout (options.timeout).
    bounded_wait(options.timeout,
                 [&] { compat::connect_full_mesh(*gloo_context, adapter, device); });
    context_ = std::move(gloo_context);
  } catch (const TimeoutError& e) {
    throw TimeoutError(ctx, fmt::format("not every rank joined within {} ms ({})",
                                        options.timeout.count(), e.what()));
  } catch (...) {
    std::rethrow_exception(detail::as_comm_error(ctx, std::current_exception()));
  }
  headers_ = std::make_unique<HeaderExchange>(context_, wire_);
  p2p_waiter_ = std::make_unique<detail::SerialExecutor>();
  executor_ = std::make_unique<detail::SerialExecutor>();
}

GlooTransport::~GlooTransport() {
  executor_.reset();
  p2p_waiter_.reset();
}

void GlooTransport::check_tensor(const at::Tensor& t, const ErrorContext& ctx,
                                 const char* what) const {
  if (!t.device().is_cpu()) {
    throw InvalidArgument(
        ctx, fmt::format("{}: Gloo needs CPU tensors, got {}", what, t.device().str()));
  }
  if (!reduce::is_supported_dtype(t.scalar_type())) {
    throw InvalidArgument(
        ctx, fmt::format("{}: dtype {} is not supported", what, c10::toString(t.scalar_type())));
  }
}

void GlooTransport::check_call(const Collective& call) const {
  if (call.op != CollectiveOp::kAllReduce && call.op != CollectiveOp::kReduceScatter) return;
  try {
    reduce::reduce_fn(call.tensor.scalar_type(), call.reduce);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(call.context, e.cause());
  }
}

WorkPtr GlooTransport::start(Collective call) {
  std::vector<at::Tensor> keep{call.tensor, call.input};
  auto work = std::make_shared<CpuWork>(static_cast<uint64_t>(call.context.sequence),
                                        call.context.op, call.context,
                                        detail::host_wait_bound(call.timeout), std::move(keep));
  executor_->submit([this, work, call = std::move(call)] {
    work->finish(failure_->run(call.context, [&] { run(call); }));
  });
  return work;
}

void GlooTransport::run(const Collective& call) {
  if (world_size_ == 1) {
    // Nothing to agree on; all_gather and reduce_scatter still copy their own part.
    if (call.op == CollectiveOp::kAllGather) all_gather(call, call.timeout);
    if (call.op == CollectiveOp::kReduceScatter) reduce_scatter(call, call.timeout);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + call.timeout;
  const auto tag = static_cast<uint32_t>(call.context.sequence);
  headers_->run(call.header, gloo::Slot::build(kHeaderSlotPrefix, tag), call.timeout);
  // The data gets what is left of the call's timeout.
  const auto left =
      std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 deadline - std::chrono::steady_clock::now()));
  switch (call.op) {
    case CollectiveOp::kAllReduce:
      return all_reduce(call, left);
    case CollectiveOp::kBroadcast:
      return broadcast(call, left);
    case CollectiveOp::kAllGather:
      return all_gather(call, left);
    case CollectiveOp::kReduceScatter:
      return reduce_scatter(call, left);
    case CollectiveOp::kBarrier:
      return barrier(call, left);
  }
}

void GlooTransport::all_reduce(const Collective& call, std::chrono::milliseconds timeout) {
  const at::Tensor& tensor = call.tensor;
  const size_t n = static_cast<size_t>(tensor.numel());
  if (n == 0) return;
  const reduce::ReduceFn fn = reduce::reduce_fn(tensor.scalar_type(), call.reduce);
  with_element_type(tensor.element_size(), [&](auto tag) {
    using T = decltype(tag);
    gloo::AllreduceOptions o(context_);
    o.setOutput<T>(static_cast<T*>(tensor.data_ptr()), n);
    o.setReduceFunction([fn](void* c, const void* a, const void* b, size_t k) { fn(c, a, b, k); });
    o.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    o.setMaxSegmentSize(options_.gloo_max_segment_bytes);
    o.setTag(static_cast<uint32_t>(call.context.sequence));
    o.setTimeout(timeout);
    bounded_wait(timeout, [&] { gloo::allreduce(o); });
  });
  wire_.sent(WireKind::kAllReduce, rank_, (rank_ + world_size_ - 1) % world_size_,
             ring_all_reduce_bytes(n * tensor.element_size(), tensor.element_size(),
                                   options_.gloo_max_segment_bytes, rank_, world_size_));
  if (call.reduce == ReduceOp::kAvg) tensor.div_(world_size_);
}

void GlooTransport::broadcast(const Collective& call, std::chrono::milliseconds timeout) {
  const at::Tensor& tensor = call.tensor;
  const size_t n = static_cast<size_t>(tensor.numel());
  if (n == 0) return;
  with_element_type(tensor.element_size(), [&](auto tag) {
    using T = decltype(tag);
    gloo::BroadcastOptions o(context_);
    o.setOutput<T>(static_cast<T*>(tensor.data_ptr()), n);
    o.setRoot(call.root);
    o.setTag(static_cast<uint32_t>(call.context.sequence));
    o.setTimeout(timeout);
    bounded_wait(timeout, [&] { gloo::broadcast(o); });
  });
  for (const int peer : broadcast_peers(rank_, call.root, world_size_)) {
    wire_.sent(WireKind::kBroadcast, rank_, peer, n * tensor.element_size());
  }
}

void GlooTransport::all_gather(const Collective& call, std::chrono::milliseconds timeout) {
  const at::Tensor& output = call.tensor;
  const at::Tensor& input = call.input;
  const size_t n = static_cast<size_t>(input.numel());
  const size_t bytes = n * input.element_size();
  auto* own = static_cast<char*>(output.data_ptr()) + rank_ * bytes;
  // The input may already be this rank's slice of the output (FSDP does that).
  if (own != input.data_ptr() && bytes > 0) std::memcpy(own, input.data_ptr(), bytes);
  if (n == 0 || world_size_ == 1) return;
  with_element_type(input.element_size(), [&](auto tag) {
    using T = decltype(tag);
    gloo::AllgatherOptions o(context_);
    o.setOutput<T>(static_cast<T*>(output.data_ptr()), n * world_size_);
    o.setTag(static_cast<uint32_t>(call.context.sequence));
    o.setTimeout(timeout);
    bounded_wait(timeout, [&] { gloo::allgather(o); });
  });
  wire_.sent(WireKind::kAllGather, rank_, (rank_ + 1) % world_size_,
             ring_all_gather_bytes(bytes, world_size_));
}

void GlooTransport::reduce_scatter(const Collective& call, std::chrono::milliseconds timeout) {
  const reduce::ReduceFn fn = reduce::reduce_fn(call.input.scalar_type(), call.reduce);
  const uint64_t slot =
      gloo::Slot::build(kReduceScatterSlotPrefix, static_cast<uint32_t>(call.context.sequence));
  bounded_wait(timeout, [&] {
    reduce_scatter_ring(*context_, call.tensor, call.input, fn, slot,
                        options_.gloo_max_segment_bytes, timeout, scratch_);
  });
  // The ring sends this rank's partial sum of one output-sized chunk per step to rank + 1.
  if (world_size_ > 1) {
    wire_.sent(WireKind::kReduceScatter, rank_, (rank_ + 1) % world_size_,
               static_cast<uint64_t>(world_size_ - 1) * static_cast<uint64_t>(call.tensor.numel()) *
                   call.tensor.element_size());
  }
  if (call.reduce == ReduceOp::kAvg) call.tensor.div_(world_size_);
}

void GlooTransport::barrier(const Collective& call, std::chrono::milliseconds timeout) {
  gloo::BarrierOptions o(context_);
  o.setTag(static_cast<uint32_t>(call.context.sequence));
  o.setTimeout(timeout);
  bounded_wait(timeout, [&] { gloo::barrier(o); });
}

WorkPtr GlooTransport::start(PointToPoint call) {
  auto work = std::make_shared<CpuWork>(
      static_cast<uint64_t>(call.context.sequence), call.context.op, call.context,
      detail::host_wait_bound(call.timeout), std::vector<at::Tensor>{call.tensor});
  executor_->submit([this, work, call = std::move(call)] {
    std::shared_ptr<gloo::transport::UnboundBuffer> buf;
    auto error = failure_->run(call.context, [&] {
      const size_t bytes = static_cast<size_t>(call.tensor.numel()) * call.tensor.element_size();
      buf = context_->createUnboundBuffer(call.tensor.data_ptr(), bytes);
      const uint64_t slot = p2p_slot(call.tag, call.tensor);
      if (call.is_send) {
        buf->send(call.peer, slot, 0, bytes);
        wire_.sent(WireKind::kPointToPoint, rank_, call.peer, bytes);
      } else {
        buf->recv(call.peer, slot, 0, bytes);
      }
    });
    if (error) {
      work->finish(error);
      return;
    }
    p2p_waiter_->submit([this, work, buf, call] {
      work->finish(failure_->run(call.context, [&] {
        bounded_wait(
            call.timeout,
            [&] {
              if (call.is_send) {
                buf->waitSend(call.timeout);
              } else {
                buf->waitRecv(call.timeout);
              }
            },
            [&](const std::string&) {
              return TimeoutError(fmt::format(
                  "no matching {} of {}[{}] with tag {} on rank {} within {} ms: the peer is late, "
                  "or "
                  "its call has another size or dtype (both are part of the match)",
                  call.is_send ? "recv" : "send", detail::dtype_name(call.tensor.scalar_type()),
                  call.tensor.numel(), call.tag, call.peer, call.timeout.count()));
            });
      }));
    });
  });
  return work;
}

}  // namespace

std::unique_ptr<detail::CollectiveEngine> make_gloo_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, detail::WireTally wire) {
  return std::make_unique<GlooTransport>(std::move(store), rank, world_size, options,
                                         std::move(failure), std::move(wire));
}

}  // namespace dtrain::gloo_backend

#include "comm/shm/hierarchical_transport.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <array>

#include "comm/gloo/gloo_transport.h"
#include "comm/reduce/reduce_ops.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/barrier.h"
#include "comm/shm/call_runner.h"
#include "comm/shm/setup.h"

namespace dtrain::shm {
namespace {

using detail::Collective;
using detail::CollectiveOp;
using detail::PointToPoint;

CommunicatorOptions renamed(CommunicatorOptions o, const std::string& suffix) {
  o.name += suffix;
  return o;
}

class HierarchicalTransport final : public detail::CollectiveEngine {
 public:
  HierarchicalTransport(std::shared_ptr<Store> store, int rank, int world_size,
                        const CommunicatorOptions& options,
                        std::shared_ptr<detail::StickyFailure> failure,
                        std::shared_ptr<detail::WireCounter> wire, HostLayout layout,
                        std::unique_ptr<detail::CollectiveEngine> p2p)
      : rank_(rank),
        world_size_(world_size),
        layout_(std::move(layout)),
        store_(std::move(store)),
        failure_(std::move(failure)),
        wire_{wire, std::vector<int>(static_cast<size_t>(world_size), 0)},
        p2p_(std::move(p2p)),
        segment_(join(options)),
        barrier_(segment_, layout_.local, layout_.hosts[static_cast<size_t>(layout_.host)]),
        leaders_(layout_.local == 0
                     ? gloo_backend::make_gloo_transport(
                           store_, layout_.host, static_cast<int>(layout_.hosts.size()),
                           renamed(options, "/leaders"), failure_, leaders_tally(wire))
                     : nullptr),
        calls_(barrier_, *failure_, *p2p_, [this](const Collective& call) { run(call); }) {}

  const char* name() const override { return "hierarchical"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void check_tensor(const at::Tensor& t, const ErrorContext& ctx, const char* what) const override {
    p2p_->check_tensor(t, ctx, what);
  }
  void check_call(const Collective& call) const override { p2p_->check_call(call); }

  WorkPtr start(Collective call) override { return calls_.start(std::move(call)); }
  WorkPtr start(PointToPoint call) override { return calls_.start(std::move(call)); }

 private:
  // The leaders' group is one rank per host: every peer is on another host.
  detail::WireTally leaders_tally(std::shared_ptr<detail::WireCounter> wire) const {
    std::vector<int> host_of(layout_.hosts.size());
    for (size_t h = 0; h < host_of.size(); ++h) host_of[h] = static_cast<int>(h);
    return detail::WireTally{std::move(wire), std::move(host_of)};
  }

  Segment join(const CommunicatorOptions& options) {
    const auto& members = layout_.hosts[static_cast<size_t>(layout_.host)];
    return *join_segment(*store_, layout_.local, static_cast<int>(members.size()),
                         renamed(options, fmt::format("/host{}", layout_.host)), true);
  }

  // The leaders' part of `call`, through Gloo, with what is left of the call's time.
  void leaders(const Collective& call, CollectiveOp op, const at::Tensor& tensor,
               const at::Tensor& input, int root, Clock::time_point deadline) {
    if (!leaders_) return;
    Collective sub;
    sub.op = op;
    sub.tensor = tensor;
    sub.input = input;
    sub.reduce = call.reduce == ReduceOp::kAvg ? ReduceOp::kSum : call.reduce;
    sub.root = root;
    sub.context = call.context;
    sub.header = call.header;  // the leaders compare the user's call
    sub.timeout =
        std::max(std::chrono::milliseconds(1),
                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    leaders_->start(std::move(sub))->wait();
  }

  // This host's ranks disagree: its leader still joins the leaders' header exchange, with a
  // header no real call has (op "?"), so the other hosts raise DesyncError at once instead
  // of waiting for this leader until their timeout.
  void tell_other_hosts(const Collective& call, Clock::time_point deadline) {
    if (!leaders_) return;
    Collective poisoned;
    poisoned.op = CollectiveOp::kBarrier;
    poisoned.context = call.context;
    poisoned.header = call.header;
    poisoned.header.op = 0;
    poisoned.timeout =
        std::max(std::chrono::milliseconds(1),
                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    try {
      leaders_->start(std::move(poisoned))->wait();
    } catch (const Error&) {  // expected: the leaders disagree
    }
  }

  // Sum (min, max) over every rank into `t` on every rank; kAvg is left as the sum.
  void reduce_everywhere(Steps& steps, const Collective& call, const at::Tensor& t,
                         Clock::time_point deadline) {
    all_reduce(steps, t, reduce::reduce_fn(t.scalar_type(), call.reduce));
    leaders(call, CollectiveOp::kAllReduce, t, at::Tensor(), -1, deadline);
    broadcast(steps, t, 0);
  }

  // A buffer of `numel` elements kept between calls (executor thread only), grown to the
  // largest call. Fresh memory for every call costs a page fault per 4 KiB: glibc maps
  // blocks above 32 MiB anew each time, which made 64 MiB reduce-scatters 15x slower than
  // 16 MiB ones per byte.
  at::Tensor scratch(size_t slot, int64_t numel, at::ScalarType dtype) {
    at::Tensor& bytes = scratch_[slot];
    const int64_t need = numel * static_cast<int64_t>(c10::elementSize(dtype));
    if (!bytes.defined() || bytes.numel() < need) {
      bytes = at::Tensor();  // free the old one first
      bytes = at::empty({need}, at::kByte);
    }
    return bytes.narrow(0, 0, need).view(dtype);
  }

  // `rank_major`'s blocks of `n` elements (block r belongs to rank r) reordered host by
  // host: hosts[0]'s ranks' blocks first, in their local order, then hosts[1]'s, ...
  at::Tensor in_host_order(const at::Tensor& rank_major, int64_t n) {
    at::Tensor out = scratch(0, rank_major.numel(), rank_major.scalar_type());
    int64_t slot = 0;
    for (const auto& ranks : layout_.hosts) {
      for (const int r : ranks) out.narrow(0, slot++ * n, n).copy_(rank_major.narrow(0, r * n, n));
    }
    return out;
  }

  void run(const Collective& call) {
    const auto deadline = Clock::now() + call.timeout;
    const auto seq = static_cast<uint64_t>(call.context.sequence);
    wire_.shared(detail::WireKind::kControl, sizeof(detail::CallHeader));
    try {
      check_headers(segment_, barrier_, layout_.local, call, deadline);
    } catch (const DesyncError&) {
      tell_other_hosts(call, deadline);
      throw;
    }
    Steps steps(segment_, barrier_, layout_.local, sets_used_, deadline, call.timeout,
                fmt::format("{} #{}", detail::to_string(call.op), seq));
    steps.count_in(wire_, detail::wire_kind(call.op));
    switch (call.op) {
      case CollectiveOp::kAllReduce:
        reduce_everywhere(steps, call, call.tensor, deadline);
        if (call.reduce == ReduceOp::kAvg) call.tensor.div_(world_size_);
        return;
      case CollectiveOp::kReduceScatter: {
        // Reduce on the host, reduce-scatter between leaders so that each host receives only
        // its own ranks' blocks (half the inter-host bytes of an all-reduce), then hand each
        // local rank its block. Host order lays those blocks side by side even where a
        // host's ranks are not consecutive.
        const int64_t n = call.tensor.numel();
        const auto per_host = static_cast<int64_t>(layout_.hosts[0].size());
        at::Tensor by_host = in_host_order(call.input, n);
        all_reduce(steps, by_host, reduce::reduce_fn(by_host.scalar_type(), call.reduce));
        at::Tensor block = scratch(1, per_host * n, call.input.scalar_type());
        leaders(call, CollectiveOp::kReduceScatter, block, by_host, -1, deadline);
        broadcast(steps, block, 0);
        call.tensor.copy_(block.narrow(0, layout_.local * n, n));
        if (call.reduce == ReduceOp::kAvg) call.tensor.div_(world_size_);
        return;
      }
      case CollectiveOp::kAllGather: {
        const int64_t n = call.input.numel();
        const auto per_host = static_cast<int64_t>(layout_.hosts[0].size());
        const auto hosts = static_cast<int64_t>(layout_.hosts.size());
        at::Tensor block = scratch(1, per_host * n, call.input.scalar_type());
        all_gather(steps, block, call.input);
        at::Tensor everything = scratch(0, hosts * per_host * n, call.input.scalar_type());
        leaders(call, CollectiveOp::kAllGather, everything, block, -1, deadline);
        broadcast(steps, everything, 0);
        for (int64_t h = 0; h < hosts; ++h) {
          for (int64_t i = 0; i < per_host; ++i) {
            const int r = layout_.hosts[static_cast<size_t>(h)][static_cast<size_t>(i)];
            call.tensor.narrow(0, r * n, n).copy_(everything.narrow(0, (h * per_host + i) * n, n));
          }
        }
        return;
      }
      case CollectiveOp::kBroadcast: {
        int root_host = 0, root_local = 0;
        for (size_t h = 0; h < layout_.hosts.size(); ++h) {
          for (size_t i = 0; i < layout_.hosts[h].size(); ++i) {
            if (layout_.hosts[h][i] == call.root) {
              root_host = static_cast<int>(h);
              root_local = static_cast<int>(i);
            }
          }
        }
        if (layout_.host == root_host) broadcast(steps, call.tensor, root_local);
        leaders(call, CollectiveOp::kBroadcast, call.tensor, at::Tensor(), root_host, deadline);
        if (layout_.host != root_host) broadcast(steps, call.tensor, 0);
        return;
      }
      case CollectiveOp::kBarrier:
        leaders(call, CollectiveOp::kBarrier, at::Tensor(), at::Tensor(), -1, deadline);
        barrier_.arrive_and_wait(deadline, call.timeout,
                                 fmt::format("reach the end of barrier #{}", seq));
        return;
    }
  }

  const int rank_;
  const int world_size_;
  const HostLayout layout_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<detail::StickyFailure> failure_;
  const detail::WireTally wire_;  // this host's segment: intra-host
  std::unique_ptr<detail::CollectiveEngine> p2p_;
  Segment segment_;
  Barrier barrier_;
  std::unique_ptr<detail::CollectiveEngine> leaders_;  // local index 0 only
  uint64_t sets_used_ = 0;                             // executor thread only
  std::array<at::Tensor, 2> scratch_;                  // executor thread only, see scratch()
  CallRunner calls_;                                   // last: destroyed first, see call_runner.h
};

}  // namespace

std::unique_ptr<detail::CollectiveEngine> make_hierarchical_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, std::shared_ptr<detail::WireCounter> wire,
    HostLayout layout, std::unique_ptr<detail::CollectiveEngine> p2p) {
  return std::make_unique<HierarchicalTransport>(std::move(store), rank, world_size, options,
                                                 std::move(failure), std::move(wire),
                                                 std::move(layout), std::move(p2p));
}

}  // namespace dtrain::shm

#include "comm/front_end.h"

#include <fmt/format.h>

#include "comm/cpu_work.h"

namespace dtrain::detail {

FrontEnd::FrontEnd(int rank, int world_size, const CommunicatorOptions& options,
                   std::shared_ptr<StickyFailure> failure, std::unique_ptr<CollectiveEngine> engine,
                   std::shared_ptr<WireCounter> wire)
    : rank_(rank),
      world_size_(world_size),
      options_(options),
      failure_(std::move(failure)),
      wire_(std::move(wire)),
      engine_(std::move(engine)) {}

FrontEnd::~FrontEnd() { engine_.reset(); }

ErrorContext FrontEnd::context(const char* op, int64_t seq) const {
  return ErrorContext{rank_, world_size_, op, seq};
}

std::chrono::milliseconds FrontEnd::call_timeout(const CallOptions& options) const {
  return options.timeout.count() > 0 ? options.timeout : options_.timeout;
}

void FrontEnd::check_tensor(const at::Tensor& t, const char* op, const char* what) const {
  const ErrorContext ctx = context(op);
  auto fail = [&](const std::string& why) {
    throw InvalidArgument(ctx, fmt::format("{}: {}", what, why));
  };
  if (!t.defined()) fail("undefined tensor");
  // Layout first: engines may read strides and data pointers of what they check.
  if (t.layout() != c10::kStrided) fail("must be a dense (strided) tensor");
  if (!t.is_contiguous()) fail("must be contiguous");
  engine_->check_tensor(t, ctx, what);
}

void FrontEnd::check_reduce(ReduceOp reduce, const at::Tensor& t, const char* op) const {
  if (reduce == ReduceOp::kAvg && !c10::isFloatingType(t.scalar_type())) {
    throw InvalidArgument(context(op), fmt::format("avg needs a floating dtype, got {}",
                                                   c10::toString(t.scalar_type())));
  }
}

void FrontEnd::check_rank(int r, const char* op, const char* what, bool others_only) const {
  if (r < 0 || r >= world_size_ || (others_only && r == rank_)) {
    throw InvalidArgument(context(op),
                          fmt::format("{} {} is not {} of [0, {})", what, r,
                                      others_only ? "another rank" : "a rank", world_size_));
  }
}

WorkPtr FrontEnd::issue(Collective call, const at::Tensor& described, bool reduces) {
  engine_->check_call(call);
  std::lock_guard<std::mutex> lock(issue_mu_);
  const uint64_t seq = next_seq_.fetch_add(1);
  call.context.sequence = static_cast<int64_t>(seq);
  call.header = make_header(call.op, seq, described,
                            reduces ? std::optional<ReduceOp>(call.reduce) : std::nullopt,
                            call.root, options_.consistency);
  if (auto earlier = failure_->check(call.context)) {
    auto work = std::make_shared<CpuWork>(seq, call.context.op, call.context,
                                          host_wait_bound(call.timeout), std::vector<at::Tensor>{});
    work->finish(earlier);
    return work;
  }
  return engine_->start(std::move(call));
}

WorkPtr FrontEnd::issue(PointToPoint call) {
  engine_->check_call(call);
  std::lock_guard<std::mutex> lock(issue_mu_);
  const uint64_t seq = next_p2p_seq_++;
  call.context.sequence = static_cast<int64_t>(seq);
  if (auto earlier = failure_->check(call.context)) {
    auto work = std::make_shared<CpuWork>(seq, call.context.op, call.context,
                                          host_wait_bound(call.timeout), std::vector<at::Tensor>{});
    work->finish(earlier);
    return work;
  }
  return engine_->start(std::move(call));
}

WorkPtr FrontEnd::all_reduce(at::Tensor tensor, ReduceOp op, const CallOptions& options) {
  check_tensor(tensor, "all_reduce", "tensor");
  check_reduce(op, tensor, "all_reduce");
  Collective call;
  call.op = CollectiveOp::kAllReduce;
  call.tensor = tensor;
  call.reduce = op;
  call.context = context("all_reduce");
  call.timeout = call_timeout(options);
  return issue(std::move(call), tensor, true);
}

WorkPtr FrontEnd::broadcast(at::Tensor tensor, int root, const CallOptions& options) {
  check_tensor(tensor, "broadcast", "tensor");
  check_rank(root, "broadcast", "root", false);
  Collective call;
  call.op = CollectiveOp::kBroadcast;
  call.tensor = tensor;
  call.root = root;
  call.context = context("broadcast");
  call.timeout = call_timeout(options);
  return issue(std::move(call), tensor, false);
}

WorkPtr FrontEnd::all_gather(at::Tensor output, at::Tensor input, const CallOptions& options) {
  check_tensor(output, "all_gather", "output");
  check_tensor(input, "all_gather", "input");
  if (output.scalar_type() != input.scalar_type() ||
      output.numel() != input.numel() * world_size_) {
    throw InvalidArgument(
        context("all_gather"),
        fmt::format("output must have world_size * input.numel() = {} elements of {}, got {} of {}",
                    input.numel() * world_size_, c10::toString(input.scalar_type()), output.numel(),
                    c10::toString(output.scalar_type())));
  }
  Collective call;
  call.op = CollectiveOp::kAllGather;
  call.tensor = output;
  call.input = input;
  call.context = context("all_gather");
  call.timeout = call_timeout(options);
  return issue(std::move(call), input, false);
}

WorkPtr FrontEnd::reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                                 const CallOptions& options) {
  check_tensor(output, "reduce_scatter", "output");
  check_tensor(input, "reduce_scatter", "input");
  if (output.scalar_type() != input.scalar_type() ||
      input.numel() != output.numel() * world_size_) {
    throw InvalidArgument(
        context("reduce_scatter"),
        fmt::format("input must have world_size * output.numel() = {} elements of {}, got {} of "
                    "{} (pad with dtrain::padded_size)",
                    output.numel() * world_size_, c10::toString(output.scalar_type()),
                    input.numel(), c10::toString(input.scalar_type())));
  }
  check_reduce(op, input, "reduce_scatter");
  Collective call;
  call.op = CollectiveOp::kReduceScatter;
  call.tensor = output;
  call.input = input;
  call.reduce = op;
  call.context = context("reduce_scatter");
  call.timeout = call_timeout(options);
  return issue(std::move(call), input, true);
}

WorkPtr FrontEnd::barrier(const CallOptions& options) {
  Collective call;
  call.op = CollectiveOp::kBarrier;
  call.context = context("barrier");
  call.timeout = call_timeout(options);
  return issue(std::move(call), at::Tensor(), false);
}

WorkPtr FrontEnd::send(at::Tensor tensor, int dst, uint32_t tag, const CallOptions& options) {
  return point_to_point(true, std::move(tensor), dst, tag, options);
}

WorkPtr FrontEnd::recv(at::Tensor tensor, int src, uint32_t tag, const CallOptions& options) {
  return point_to_point(false, std::move(tensor), src, tag, options);
}

WorkPtr FrontEnd::point_to_point(bool is_send, at::Tensor tensor, int peer, uint32_t tag,
                                 const CallOptions& options) {
  const char* op = is_send ? "send" : "recv";
  check_tensor(tensor, op, "tensor");
  check_rank(peer, op, "peer rank", true);
  PointToPoint call;
  call.is_send = is_send;
  call.tensor = std::move(tensor);
  call.peer = peer;
  call.tag = tag;
  call.context = context(op);
  call.timeout = call_timeout(options);
  return issue(std::move(call));
}

}  // namespace dtrain::detail

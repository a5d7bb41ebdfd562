#include <ATen/ATen.h>

#include <fmt/format.h>

#include "dtrain/comm_hook.h"
#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain {
namespace {

class AllReduceHook final : public CommHook {
 public:
  WorkPtr run(Communicator& comm, GradBucket& b) override {
    return comm.all_reduce(b.buffer, ReduceOp::kAvg);
  }
  std::string name() const override { return "allreduce"; }
};

class CompressHook final : public CommHook {
 public:
  explicit CompressHook(c10::ScalarType wire) : wire_(wire) {}

  WorkPtr run(Communicator& comm, GradBucket& b) override {
    at::Tensor compressed = b.buffer.to(wire_);
    // Sum in the wire dtype and divide once in full precision: dividing before the sum
    // would lose fp16 precision on small gradients.
    auto work = comm.all_reduce(compressed, ReduceOp::kSum);
    const double world = comm.world_size();
    return then(work, [buffer = b.buffer, compressed, world]() mutable {
      buffer.copy_(compressed);
      buffer.div_(world);
    });
  }
  std::string name() const override {
    return wire_ == at::kHalf ? "fp16_compress" : "bf16_compress";
  }

 private:
  c10::ScalarType wire_;
};

class ParameterServerHook final : public CommHook {
 public:
  explicit ParameterServerHook(int root) : root_(root) {}

  WorkPtr run(Communicator& comm, GradBucket& b) override {
    const int world = comm.world_size();
    if (root_ < 0 || root_ >= world) {
      throw InvalidArgument(ErrorContext{comm.rank(), world, "parameter_server_hook", -1},
                            fmt::format("root {} is not a rank of [0, {})", root_, world));
    }
    if (world == 1) return comm.all_reduce(b.buffer, ReduceOp::kAvg);
    // The bucket index tags the transfers so that buckets in flight never mix. NCCL has no
    // tags and refuses any but 0 (docs/nccl.md): there a pair's messages match in issue
    // order, which is the buckets' order on every rank.
    const uint32_t tag = comm.backend() == Backend::kNccl ? 0u : static_cast<uint32_t>(b.index);
    at::Tensor buffer = b.buffer;
    Communicator* c = &comm;
    const int root = root_;
    if (comm.rank() != root_) {
      auto sent = comm.send(buffer, root_, tag);
      // The broadcast is issued when the bucket is waited for: buckets are waited for in
      // index order on every rank, so broadcasts line up across ranks.
      return then(sent, [c, buffer, root]() mutable { c->broadcast(buffer, root)->wait(); });
    }
    std::vector<at::Tensor> incoming;
    std::vector<WorkPtr> recvs;
    for (int r = 0; r < world; ++r) {
      if (r == root_) continue;
      incoming.push_back(at::empty_like(buffer));
      recvs.push_back(comm.recv(incoming.back(), r, tag));
    }
    auto last = recvs.back();
    return then(last, [c, buffer, incoming, recvs, root, world]() mutable {
      for (auto& w : recvs) w->wait();
      for (auto& t : incoming) buffer.add_(t);
      buffer.div_(world);
      c->broadcast(buffer, root)->wait();
    });
  }
  std::string name() const override { return "parameter_server"; }

 private:
  int root_;
};

}  // namespace

void CommHook::load_state(const std::map<std::string, at::Tensor>& state) {
  if (!state.empty()) {
    throw InvalidArgument(
        ErrorContext{-1, -1, "CommHook::load_state", -1},
        fmt::format("hook '{}' keeps no state, got \"{}\"", name(), state.begin()->first));
  }
}

std::shared_ptr<CommHook> allreduce_hook() { return std::make_shared<AllReduceHook>(); }
std::shared_ptr<CommHook> fp16_compress_hook() { return std::make_shared<CompressHook>(at::kHalf); }
std::shared_ptr<CommHook> bf16_compress_hook() {
  return std::make_shared<CompressHook>(at::kBFloat16);
}
std::shared_ptr<CommHook> parameter_server_hook(int root) {
  return std::make_shared<ParameterServerHook>(root);
}

}  // namespace dtrain

// Gloo backend: CPU tensors over Gloo's TCP transport.
//
// Every call runs on one executor thread per communicator, in issue order, so compute on
// the caller's thread overlaps communication and every rank runs collectives in the same
// order. Point-to-point transfers are posted on that thread (keeping their order relative
// to collectives) and completed on a second one, so that a send waiting for its peer
// does not hold up later collectives.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

#include "comm/cpu_work.h"
#include "dtrain/communicator.h"

namespace gloo {
class Context;
}

namespace dtrain::gloo_backend {

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<Store> store, int rank, int world_size,
                   const CommunicatorOptions& options);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Backend backend() const override { return Backend::kGloo; }
  uint64_t sequence_number() const override { return seq_.load(); }

  WorkPtr all_reduce(at::Tensor tensor, ReduceOp op, const CallOptions& options) override;
  WorkPtr broadcast(at::Tensor tensor, int root, const CallOptions& options) override;
  WorkPtr all_gather(at::Tensor output, at::Tensor input, const CallOptions& options) override;
  WorkPtr reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                         const CallOptions& options) override;
  WorkPtr barrier(const CallOptions& options) override;
  WorkPtr send(at::Tensor tensor, int dst, uint32_t tag, const CallOptions& options) override;
  WorkPtr recv(at::Tensor tensor, int src, uint32_t tag, const CallOptions& options) override;

 private:
  using Body = std::function<void(std::chrono::milliseconds timeout, uint64_t seq)>;

  WorkPtr enqueue(const char* op, std::vector<at::Tensor> tensors, const CallOptions& options,
                  Body body);
  WorkPtr enqueue_p2p(const char* op, at::Tensor tensor, int peer, uint32_t tag,
                      const CallOptions& options, bool is_send);
  // Throws InvalidArgument (with rank/op context) unless t is a dense contiguous CPU tensor
  // of a supported dtype.
  void check_tensor(const at::Tensor& t, const char* op, const char* what) const;
  void check_peer(int peer, const char* op) const;
  std::chrono::milliseconds call_timeout(const CallOptions& options) const;
  ErrorContext context(const char* op, int64_t seq) const;
  // Runs body, turning any failure into a dtrain::Error and breaking the communicator.
  std::exception_ptr run_guarded(const ErrorContext& ctx, const std::function<void()>& body);

  const int rank_;
  const int world_size_;
  const CommunicatorOptions options_;
  // Kept for the communicator's lifetime: on rank 0 it may host the TCP store server that
  // slower ranks still need to finish their own rendezvous.
  std::shared_ptr<Store> store_;
  std::shared_ptr<gloo::Context> context_;
  std::atomic<uint64_t> seq_{0};
  // Point-to-point calls are numbered apart: ranks issue different numbers of them, and
  // collectives use their sequence number as Gloo's tag, which must match across ranks.
  std::atomic<uint64_t> p2p_seq_{0};

  // Chunk-sized scratch of reduce_scatter (the partial sum and two receive buffers), grown
  // on demand; executor thread only.
  at::Tensor scratch(int slot, int64_t numel, const at::Tensor& like);
  at::Tensor scratch_[3];

  std::mutex broken_mu_;
  std::exception_ptr broken_;  // first failure; sticky

  // Declared last: destroyed first, so queued calls finish while members above live.
  std::unique_ptr<detail::SerialExecutor> p2p_waiter_;
  std::unique_ptr<detail::SerialExecutor> executor_;
};

}  // namespace dtrain::gloo_backend

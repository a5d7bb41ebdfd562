// The one Communicator every backend sits behind: argument checks, per-call timeouts,
// sequence numbers, the call's consistency header and the sticky failure, for every
// backend alike. Backends (Transport, transport.h) only move data.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

#include "comm/failure.h"
#include "comm/transport.h"
#include "dtrain/communicator.h"

namespace dtrain::detail {

class FrontEnd final : public Communicator {
 public:
  // `failure` is shared with `transport`, which records what fails while a call runs.
  FrontEnd(int rank, int world_size, const CommunicatorOptions& options,
           std::shared_ptr<StickyFailure> failure, std::unique_ptr<Transport> transport);
  // Destroys the transport first: it finishes or fails what is still queued.
  ~FrontEnd() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Backend backend() const override { return transport_->backend(); }
  const char* transport_name() const override { return transport_->name(); }
  c10::Device device() const override { return transport_->device(); }
  uint64_t sequence_number() const override { return next_seq_.load(); }

  WorkPtr all_reduce(at::Tensor tensor, ReduceOp op, const CallOptions& options) override;
  WorkPtr broadcast(at::Tensor tensor, int root, const CallOptions& options) override;
  WorkPtr all_gather(at::Tensor output, at::Tensor input, const CallOptions& options) override;
  WorkPtr reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                         const CallOptions& options) override;
  WorkPtr barrier(const CallOptions& options) override;
  WorkPtr send(at::Tensor tensor, int dst, uint32_t tag, const CallOptions& options) override;
  WorkPtr recv(at::Tensor tensor, int src, uint32_t tag, const CallOptions& options) override;

 private:
  ErrorContext context(const char* op, int64_t seq = -1) const;
  std::chrono::milliseconds call_timeout(const CallOptions& options) const;
  // Throws InvalidArgument naming rank and op unless `t` is dense, contiguous and usable by
  // the transport.
  void check_tensor(const at::Tensor& t, const char* op, const char* what) const;
  void check_reduce(ReduceOp reduce, const at::Tensor& t, const char* op) const;
  void check_rank(int r, const char* op, const char* what, bool others_only) const;
  // Numbers the call, fills in its header and hands it to the transport, as one step.
  WorkPtr issue(Collective call, const at::Tensor& described, bool reduces);
  WorkPtr issue(PointToPoint call);
  // send and recv: the same checks and numbering, one direction flag.
  WorkPtr point_to_point(bool is_send, at::Tensor tensor, int peer, uint32_t tag,
                         const CallOptions& options);

  const int rank_;
  const int world_size_;
  const CommunicatorOptions options_;
  std::shared_ptr<StickyFailure> failure_;
  std::unique_ptr<Transport> transport_;

  // Held while a call is numbered and queued, so that numbering is execution order.
  std::mutex issue_mu_;
  std::atomic<uint64_t> next_seq_{0};
  // Point-to-point calls are numbered apart: ranks issue different numbers of them.
  uint64_t next_p2p_seq_ = 0;
};

}  // namespace dtrain::detail

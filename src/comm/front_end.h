// The one Communicator every backend sits behind: argument checks, per-call timeouts,
// sequence numbers, the call's consistency header and refusing calls once the communicator
// failed (sticky), for every backend alike. Collective engines (engine.h) move the data.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

#include "comm/engine.h"
#include "comm/failure.h"
#include "comm/wire_counter.h"
#include "dtrain/communicator.h"

namespace dtrain::detail {

class FrontEnd final : public Communicator {
 public:
  // `failure` is shared with `engine`, which records what fails while a call runs.
  // `options.backend` is what backend() reports: the backend asked for (kGloo for every CPU
  // transport, shared memory and hierarchical included; transport_name() says which). `wire` is
  // what the engine counts its bytes in (wire_counter.h); null: not counted.
  FrontEnd(int rank, int world_size, const CommunicatorOptions& options,
           std::shared_ptr<StickyFailure> failure, std::unique_ptr<CollectiveEngine> engine,
           std::shared_ptr<WireCounter> wire);
  // Destroys the engine first: it finishes or fails what is still queued.
  ~FrontEnd() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Backend backend() const override { return options_.backend; }
  const char* transport_name() const override { return engine_->name(); }
  c10::Device device() const override { return engine_->device(); }
  uint64_t sequence_number() const override { return next_seq_.load(); }
  // What dtrain::wire_stats(const Communicator&) reports (wire_stats.h).
  WireStats wire_stats() const { return wire_ ? wire_->snapshot() : WireStats{}; }

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
  // Throws InvalidArgument naming rank and op unless `t` is defined, dense and contiguous
  // (checked in that order, before the engine's check_tensor), and usable by the engine.
  void check_tensor(const at::Tensor& t, const char* op, const char* what) const;
  void check_reduce(ReduceOp reduce, const at::Tensor& t, const char* op) const;
  void check_rank(int r, const char* op, const char* what, bool others_only) const;
  // Checks the call with the engine, then, as one step under issue_mu_: numbers it, fills in
  // its header and hands it to the engine, or fails it at once if the communicator failed.
  WorkPtr issue(Collective call, const at::Tensor& described, bool reduces);
  WorkPtr issue(PointToPoint call);
  // send and recv: the same checks and numbering, one direction flag.
  WorkPtr point_to_point(bool is_send, at::Tensor tensor, int peer, uint32_t tag,
                         const CallOptions& options);

  const int rank_;
  const int world_size_;
  const CommunicatorOptions options_;
  std::shared_ptr<StickyFailure> failure_;
  std::shared_ptr<WireCounter> wire_;
  std::unique_ptr<CollectiveEngine> engine_;

  // Held while a call is numbered and queued, so that numbering is execution order.
  std::mutex issue_mu_;
  std::atomic<uint64_t> next_seq_{0};
  // Point-to-point calls are numbered apart: ranks issue different numbers of them.
  uint64_t next_p2p_seq_ = 0;
};

}  // namespace dtrain::detail

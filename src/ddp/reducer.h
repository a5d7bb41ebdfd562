// DDP's reducer, c10d's scope: gradient buckets and the hooks that fill them. Each trainable
// parameter's .grad is a view into a flat bucket; gradient-ready hooks count each bucket down
// during backward and launch it, strictly in bucket order on every rank, through the comm
// hook. The step protocol around it (agreements, failures, stats) is the StepDriver's
// (strategy/step_driver.h), run by DataParallel (ddp/data_parallel.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/comm_hook.h"
#include "dtrain/communicator.h"
#include "dtrain/strategy.h"
#include "strategy/grad_hooks.h"
#include "strategy/step_failure.h"

namespace dtrain::ddp {

struct ReducerOptions {
  int64_t first_bucket_cap_bytes = 0, bucket_cap_bytes = 0;
  bool rebuild_buckets = true;
  bool find_unused_parameters = false;
};

class Reducer {
 public:
  // `params`: the trainable parameters in registration order. Hooks report a comm hook that
  // threw while issuing to `failure` (this rank's collectives are then out of step).
  Reducer(std::vector<at::Tensor> params, CommunicatorPtr comm, std::shared_ptr<CommHook> hook,
          ReducerOptions options, StepFailure& failure);
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Start of a forward: after the first synced iteration, the buckets are rebuilt once in
  // the order gradients became ready (a collective); .grad tensors replaced or set to none
  // since the last step go back into their buckets.
  void prepare_forward(bool gradient_sync);
  // loss.backward() with the buckets armed (gradient_sync) or accumulating locally, then
  // every bucket waited for. Returns a failure that left the collectives in step (autograd,
  // or a hook's continuation, threw); throws StepBreak on one that did not.
  std::exception_ptr backward(const at::Tensor& loss, bool gradient_sync);
  // The forward threw on this rank: issue the buckets a peer's synced backward issues (this
  // rank's dropped gradients in them).
  void issue_as_peers_do(bool gradient_sync);
  // Every rank's backward succeeded.
  void commit(bool gradient_sync);
  // A failed step leaves every gradient zero, as after zero_grad().
  void reset_after_failure();

  const std::vector<at::Tensor>& params() const { return params_; }
  std::vector<at::Tensor> bucket_buffers() const;
  const std::shared_ptr<CommHook>& hook() const { return hook_; }
  // The step's bytes, collectives and waits (StepStats without the wire).
  StepStats counters() const;
  // Parameter indices of each bucket, in launch order; the launch order of the last backward.
  const std::vector<std::vector<size_t>>& assignment() const { return assignment_; }
  std::vector<int> launch_order() const;

  // StateLayout::rank_state: the bucket layout and step count (a resumed run must reduce
  // in the same buckets: hooks keep per-bucket state, and bucket boundaries decide the
  // reduction's round-off) and the comm hook's state. Between steps.
  std::map<std::string, at::Tensor> rank_state() const;
  void load_rank_state(const std::map<std::string, at::Tensor>& state);

 private:
  using Clock = std::chrono::steady_clock;
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;
    at::Tensor flat;
    int pending = 0;
    WorkPtr work;
  };

  ErrorContext ctx(const char* op) const;
  void build_buckets(const std::vector<size_t>& order);
  void ensure_grad_views();
  void on_grad_ready(size_t param);
  void launch_ready_buckets();
  void launch(size_t b);
  // Every remaining bucket, in order, waited for, and the unused-parameter all-reduce.
  // Returns a failure that left the collectives in step (a hook's continuation threw);
  // throws StepBreak on any other.
  std::exception_ptr complete_communication(std::vector<uint8_t>& used_everywhere);
  void apply_unused_parameters(const std::vector<uint8_t>& used_everywhere);
  void rebuild_from_ready_order();
  void start_counting();  // a step's counters and launch state from zero

  std::vector<at::Tensor> params_;
  CommunicatorPtr comm_;
  std::shared_ptr<CommHook> hook_;
  ReducerOptions options_;
  StepFailure& failure_;

  std::vector<std::vector<size_t>> assignment_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> grad_views_;  // per parameter, aliasing its bucket
  std::vector<size_t> bucket_of_;

  mutable std::mutex mu_;  // hooks run on autograd's threads
  bool armed_ = false;
  size_t next_launch_ = 0;
  std::vector<int> launch_order_;
  std::vector<uint8_t> used_;  // got its gradient in this backward (bucket readiness)
  // Got a gradient in some backward since the last synced one (no_sync micro-batches
  // included): c10d's rule, a parameter used once in a no_sync session counts as used.
  std::vector<uint8_t> used_since_sync_;
  std::vector<uint8_t> grad_was_none_;  // .grad was undefined at some point this step
  std::vector<size_t> ready_order_;
  std::vector<uint8_t> used_everywhere_;  // the unused-parameter all-reduce's result
  int64_t iteration_ = 0;
  bool rebuilt_ = false;
  StepStats counters_;
  Clock::time_point first_launch_;
  GradReadyHooks hooks_;  // last: destroyed first, so no hook runs on a dying reducer
};

}  // namespace dtrain::ddp

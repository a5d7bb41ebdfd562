// DataParallel: distributed data parallelism (DDP) for any torch::nn::Module.
//
// Every rank holds the whole model and computes gradients on its part of the global
// batch; gradients are averaged over ranks in buckets while backward still runs, so the
// communication hides behind the remaining backward computation.
//
// Construction broadcasts parameters and buffers from rank 0 after checking that every
// rank has the same parameter names, shapes and dtypes (a mismatch throws
// InvalidArgument on every rank, naming the first difference).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm_hook.h"
#include "dtrain/communicator.h"
#include "dtrain/strategy.h"

namespace dtrain {

struct DataParallelOptions {
  // Largest bucket, in MiB. Bigger buckets mean fewer, more efficient collectives but a
  // later first launch (less overlap).
  double bucket_cap_mb = 25.0;
  // The first bucket (the last layers' gradients, ready first) is kept small so that
  // communication starts early in backward.
  double first_bucket_cap_mb = 1.0;
  // After the first iteration, rebuild buckets in the order gradients actually became
  // ready (rank 0's order, broadcast so that it is identical everywhere).
  bool rebuild_buckets = true;
  // Parameters that got no gradient in a step are always handled (their bucket is flushed
  // at the end of backward, with zeros). With this flag, a parameter that got no gradient
  // on ANY rank additionally has its .grad reset to undefined, as single-device training
  // would leave it, so optimizers skip it; costs one small all-reduce per step.
  bool find_unused_parameters = false;
  // Re-broadcast buffers (e.g. BatchNorm running stats) from rank 0 before each forward.
  bool broadcast_buffers = true;
  // How buckets are reduced; null means allreduce_hook().
  std::shared_ptr<CommHook> comm_hook;
  // When ranks agree on a step's outcome (see StepChecks).
  StepChecks step_checks = StepChecks::kAuto;
};

namespace detail {
struct Inspect;
}  // namespace detail

class DataParallel final : public Strategy {
 public:
  DataParallel(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
               DataParallelOptions options = {});
  ~DataParallel() override;

  void backward(const at::Tensor& loss) override;
  std::vector<at::Tensor> parameters() override;
  std::vector<NamedParameter> named_parameters() override;
  double grad_norm() override;
  at::Tensor grad_norm_tensor() override;
  int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state = {}) override;
  const StepStats& last_step_stats() const override;
  StateLayout state_layout() override;
  void finish() override;
  std::string name() const override { return "ddp"; }
  int rank() const override;
  int world_size() const override;

  // Gradient accumulation: Strategy::no_sync() / set_requires_gradient_sync(). Under it
  // backward() accumulates into the buckets without communicating; the first synced backward
  // reduces the accumulated sum.

  // The bucket launch order observed in the last synced backward.
  std::vector<int> last_launch_order() const;

 protected:
  void begin_forward() override;
  void end_forward(at::Tensor& output) override;
  void forward_failed(std::exception_ptr error) noexcept override;

 private:
  friend struct detail::Inspect;  // tests' and benchmarks' view of the buckets (src/)
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain

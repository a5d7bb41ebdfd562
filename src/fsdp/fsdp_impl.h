// The FullyShardedDataParallel façade's state: options turned into groups and dtypes, the
// schedule (which owns the units), and the step agreements. fsdp.cpp runs a step through
// them; state.cpp reads and writes the training state (state dicts, checkpoint layout).
#pragma once

#include <ATen/core/Tensor.h>

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "compat/autocast.h"
#include "dtrain/fsdp.h"
#include "fsdp/buffer_pool.h"
#include "fsdp/schedule.h"
#include "fsdp/sequential_units.h"
#include "strategy/step_driver.h"

namespace dtrain {

class FullyShardedDataParallel::Impl final : public StepParticipant {
 public:
  Impl(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh, FsdpOptions options);
  ~Impl();

  // gradient_sync: Strategy::requires_gradient_sync() of the step.
  void begin_forward(bool gradient_sync);
  void end_forward();
  void forward_failed(std::exception_ptr error);
  void finish();
  void backward(const at::Tensor& loss, bool gradient_sync);
  const StepStats& last_step_stats() const { return driver_.last_stats(); }
  at::Tensor grad_norm();
  int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state);
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict();
  std::vector<std::pair<std::string, at::Tensor>> sharded_state_dict();
  void load_sharded_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state);
  StateLayout state_layout();
  void state_loaded();

  const CommunicatorPtr& comm() const { return comm_; }
  const fsdp::Schedule& schedule() const { return *schedule_; }
  // FsdpOptions::use_orig_params: the per-parameter shard views (module order), or throws.
  std::vector<NamedParameter> named_parameters() const;
  // What the optimizer steps: the views with use_orig_params, else the units' flat shards.
  // parameters() hands them out (see shards_handed_out_); stepped() is for FSDP's own use.
  std::vector<at::Tensor> parameters() const;
  std::vector<at::Tensor> stepped() const;

 private:
  ErrorContext ctx(const char* op) const {
    return ErrorContext{comm_->rank(), comm_->world_size(), op, -1};
  }
  void build_units();
  void cast_buffers();
  // MixedPrecision::cast_forward_inputs: the autocast region around the forward's fn.
  void enter_forward_autocast();
  void leave_forward_autocast();

  // StepParticipant
  void start_forward(bool training, bool gradient_sync) override;
  void end_forward(bool training) override;
  void issue_as_peers_do(bool training, bool gradient_sync) override;
  std::exception_ptr run_backward(const at::Tensor& loss, bool gradient_sync) override;
  void commit_backward(bool gradient_sync) override;
  void reset_after_failure(bool training) noexcept override;
  StepStats step_counters() const override { return schedule_->counters(); }
  // A training forward: null, or the InvalidArgument for an optimizer built over the
  // module's parameters (see shards_handed_out_).
  std::exception_ptr check_optimizer_parameters() const;

 public:
  // Once constructed: the unit parameters' reference counts, FSDP's own holders only.
  void record_param_refs();

 private:
  std::vector<int64_t> unit_param_refs() const;

  CommunicatorPtr comm_;
  std::shared_ptr<torch::nn::Module> module_;
  FsdpOptions options_;
  fsdp::UnitComms comms_;  // the options turned into groups
  // The step protocol. StepStats::wire counts the world's communicator and the units' groups
  // (shard, replicate, host), from forward()'s start to backward()'s end, plus grad_norm()'s
  // all-reduce.
  StepDriver driver_;
  int shard_size_ = 1, shard_rank_ = 0;
  c10::ScalarType param_dtype_ = c10::ScalarType::Float;
  // Gathered-buffer memory shared by units of equal size; declared before schedule_, which
  // holds units that point to it, so it is destroyed after them.
  fsdp::BufferPool buffer_pool_;
  std::unique_ptr<fsdp::Schedule> schedule_;
  // Units that are Sequential entries, routed through unit_call; restored first on destruction.
  std::unique_ptr<fsdp::SequentialUnits> sequential_units_;
  // use_orig_params: each parameter in module order, a trainable one as its shard view, a
  // frozen one (in no unit) as itself.
  std::vector<NamedParameter> views_;
  std::vector<at::Tensor> frozen_;  // the frozen parameters, module order
  // MixedPrecision::buffer_dtype: the original dtype of each buffer that was cast, by name,
  // and the original-dtype copies the last state_layout() handed out (written back by
  // state_loaded()).
  std::map<std::string, c10::ScalarType> buffer_dtypes_;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffer_copies_;  // (module buffer, copy)
  // cast_forward_inputs: the autocast state of the forward (param_dtype for the parameters'
  // device type), and the caller's while one is entered.
  std::optional<compat::AutocastState> forward_autocast_, autocast_saved_;
  // An optimizer built over model->parameters() steps the module's own parameters, which
  // FSDP frees between steps and gives no gradient: it would train nothing, silently. Such an
  // optimizer holds a reference to every one of them. So at each training forward, until
  // parameters() or named_parameters() hands the shards out, FSDP compares each unit
  // parameter's reference count with the one at construction: all of them held once more is
  // that mistake, refused on every rank (a loop with no optimizer holds none of them).
  mutable bool shards_handed_out_ = false;
  std::vector<int64_t> param_refs_;  // use_count() of each unit parameter once constructed
};

}  // namespace dtrain

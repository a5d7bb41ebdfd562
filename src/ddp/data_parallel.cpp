// DataParallel: the module replicated on every rank, gradients all-reduced in buckets during
// backward (ddp/reducer.h), each step run by the StepDriver (strategy/step_driver.h).
#include "dtrain/data_parallel.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <string>

#include "ddp/reducer.h"
#include "dtrain/errors.h"
#include "strategy/inspect.h"
#include "strategy/module_sync.h"
#include "strategy/state_layout.h"
#include "strategy/step_driver.h"

namespace dtrain {
namespace {

std::vector<at::Tensor> trainable(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

std::shared_ptr<CommHook> hook_of(const DataParallelOptions& o) {
  return o.comm_hook ? o.comm_hook : allreduce_hook();
}

std::vector<CommunicatorPtr> wire_comms(const CommunicatorPtr& comm, const CommHook& hook) {
  std::vector<CommunicatorPtr> used = hook.communicators();
  used.insert(used.begin(), comm);
  return used;
}

CommunicatorPtr checked(CommunicatorPtr comm, const std::shared_ptr<torch::nn::Module>& module,
                        const DataParallelOptions& o) {
  if (!comm) throw InvalidArgument("DataParallel: communicator is null");
  const ErrorContext ctx{comm->rank(), comm->world_size(), "DataParallel()", -1};
  if (!module) throw InvalidArgument(ctx, "module is null");
  if (o.bucket_cap_mb <= 0 || o.first_bucket_cap_mb <= 0) {
    throw InvalidArgument(ctx, "bucket caps must be positive");
  }
  return comm;
}

int64_t mib_bytes(double mb) { return static_cast<int64_t>(mb * 1024 * 1024); }

}  // namespace

class DataParallel::Impl final : public StepParticipant {
 public:
  Impl(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm, DataParallelOptions options)
      : comm_(checked(std::move(comm), module, options)),
        module_(std::move(module)),
        options_(std::move(options)),
        hook_(hook_of(options_)),
        driver_("DataParallel", comm_, options_.step_checks, wire_comms(comm_, *hook_), *this) {
    agree_on_initial_state(*comm_, *module_, "DataParallel()");
    for (const auto& b : module_->buffers(/*recurse=*/true)) buffers_.push_back(b);
    reducer_ = std::make_unique<ddp::Reducer>(
        trainable(*module_), comm_, hook_,
        ddp::ReducerOptions{mib_bytes(options_.first_bucket_cap_mb),
                            mib_bytes(options_.bucket_cap_mb), options_.rebuild_buckets,
                            options_.find_unused_parameters},
        driver_.failure());
  }

  StepDriver& driver() { return driver_; }
  const StepDriver& driver() const { return driver_; }
  ddp::Reducer& reducer() { return *reducer_; }
  const ddp::Reducer& reducer() const { return *reducer_; }
  torch::nn::Module& module() { return *module_; }
  const CommunicatorPtr& comm() const { return comm_; }
  const DataParallelOptions& options() const { return options_; }

  // StepParticipant
  void start_forward(bool /*training*/, bool gradient_sync) override {
    reducer_->prepare_forward(gradient_sync);
    if (options_.broadcast_buffers && !buffers_.empty()) broadcast_from_rank0(*comm_, buffers_);
  }
  void issue_as_peers_do(bool training, bool gradient_sync) override {
    // An evaluation issues nothing after the module's code; a training step's backward does.
    if (training) reducer_->issue_as_peers_do(gradient_sync);
  }
  std::exception_ptr run_backward(const at::Tensor& loss, bool gradient_sync) override {
    return reducer_->backward(loss, gradient_sync);
  }
  void commit_backward(bool gradient_sync) override { reducer_->commit(gradient_sync); }
  void reset_after_failure(bool training) noexcept override {
    if (training) reducer_->reset_after_failure();
  }
  StepStats step_counters() const override { return reducer_->counters(); }

 private:
  CommunicatorPtr comm_;
  std::shared_ptr<torch::nn::Module> module_;
  DataParallelOptions options_;
  std::shared_ptr<CommHook> hook_;
  std::vector<at::Tensor> buffers_;
  StepDriver driver_;
  std::unique_ptr<ddp::Reducer> reducer_;  // after driver_: it reports to driver_.failure()
};

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
                           DataParallelOptions options)
    : impl_(std::make_unique<Impl>(std::move(module), std::move(comm), std::move(options))) {}

DataParallel::~DataParallel() = default;

void DataParallel::begin_forward() { impl_->driver().begin_forward(requires_gradient_sync()); }
void DataParallel::end_forward(at::Tensor& /*output*/) { impl_->driver().end_forward(); }
void DataParallel::forward_failed(std::exception_ptr error) noexcept {
  impl_->driver().forward_failed(std::move(error));
}
void DataParallel::backward(const at::Tensor& loss) {
  impl_->driver().backward(loss, requires_gradient_sync());
}
void DataParallel::finish() { impl_->driver().finish(); }

std::vector<at::Tensor> DataParallel::parameters() { return impl_->module().parameters(); }
std::vector<NamedParameter> DataParallel::named_parameters() {
  return module_named_parameters(impl_->module());
}

StateLayout DataParallel::state_layout() {
  StateLayout layout = replicated_state_layout(impl_->module(), impl_->comm(), "replicated (ddp)");
  layout.rank_state = impl_->reducer().rank_state();
  ddp::Reducer* reducer = &impl_->reducer();  // the layout is used while the strategy lives
  layout.load_rank_state = [reducer](const std::map<std::string, at::Tensor>& state) {
    reducer->load_rank_state(state);
  };
  // Broadcast buffers are rank 0's at the next forward anyway: the model entry suffices.
  if (!impl_->options().broadcast_buffers) keep_rank_buffers(layout);
  return layout;
}

double DataParallel::grad_norm() { return grad_norm_tensor().item<double>(); }
at::Tensor DataParallel::grad_norm_tensor() {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : impl_->reducer().params()) grads.push_back(p.grad());
  return squared_norm_sum(grads, impl_->comm()->device()).sqrt_();
}

int64_t DataParallel::model_state_bytes(const std::vector<at::Tensor>& optimizer_state) {
  std::vector<at::Tensor> all = optimizer_state;
  for (const auto& p : impl_->module().parameters()) {
    all.push_back(p);
    all.push_back(p.grad());
  }
  for (const auto& b : impl_->reducer().bucket_buffers()) all.push_back(b);
  return tensor_bytes(all);
}

const StepStats& DataParallel::last_step_stats() const { return impl_->driver().last_stats(); }
int DataParallel::rank() const { return impl_->comm()->rank(); }
int DataParallel::world_size() const { return impl_->comm()->world_size(); }
std::vector<int> DataParallel::last_launch_order() const { return impl_->reducer().launch_order(); }

namespace detail {

std::vector<std::vector<size_t>> Inspect::bucket_assignment(const DataParallel& ddp) {
  return ddp.impl_->reducer().assignment();
}

}  // namespace detail

}  // namespace dtrain

#include "dtrain/data_parallel.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "comm/control_plane.h"
#include "compat/torch_compat.h"
#include "dtrain/errors.h"
#include "strategy/inspect.h"
#include "strategy/module_sync.h"
#include "strategy/state_layout.h"
#include "strategy/step_sync.h"
#include "strategy/step_wire.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

// An alias of `flat`'s storage shaped like `like`, that autograd does not see as a view:
// optimizers may detach_() and zero_() it in place.
at::Tensor alias_into(const at::Tensor& flat, int64_t offset, const at::Tensor& like) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, like.sizes(), like.strides());
  return t;
}

}  // namespace

class DataParallel::Reducer {
 public:
  Reducer(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
          DataParallelOptions options);
  ~Reducer() { token_.reset(); }

  // gradient_sync: Strategy::requires_gradient_sync() of the step, passed in as FSDP's
  // implementation takes it (the step's setting is read at forward and at backward).
  void begin_forward(bool gradient_sync);
  void end_forward();
  void forward_failed(std::exception_ptr error);
  void backward(const at::Tensor& loss, bool gradient_sync);
  void finish();
  at::Tensor grad_norm();
  int64_t model_state_bytes(const std::vector<at::Tensor>& optimizer_state);
  // StateLayout::rank_state: the bucket layout and step count (a resumed run must reduce
  // in the same buckets: hooks keep per-bucket state, and bucket boundaries decide the
  // reduction's round-off) and the comm hook's state. Between steps.
  std::map<std::string, at::Tensor> rank_state() const;
  void load_rank_state(const std::map<std::string, at::Tensor>& state);

  std::shared_ptr<torch::nn::Module> module_;
  CommunicatorPtr comm_;
  DataParallelOptions options_;
  std::shared_ptr<CommHook> hook_;
  StepStats stats_;
  std::vector<std::vector<size_t>> assignment_;
  std::vector<int> launch_order_;
  std::vector<at::Tensor> params_;  // trainable parameters, registration order

 private:
  bool sync_ = true;  // the step's gradient_sync (begin_forward, backward)
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;
    at::Tensor flat;
    int pending = 0;
    WorkPtr work;
  };

  ErrorContext ctx(const char* op) const {
    return ErrorContext{comm_->rank(), comm_->world_size(), op, -1};
  }
  void build_buckets(const std::vector<size_t>& order);
  void ensure_grad_views();
  void on_grad_ready(size_t param);
  void launch_ready_buckets();
  void launch(size_t b);
  // What backward communicates once autograd is done (or failed): every remaining bucket,
  // in order, waited for, and the unused-parameter all-reduce. Returns a failure that left
  // the collectives in step (a hook's continuation threw); breaks on any other.
  std::exception_ptr complete_communication(std::vector<uint8_t>& used_everywhere);
  void apply_unused_parameters(const std::vector<uint8_t>& used_everywhere);
  void reset_after_failure();
  void rebuild_from_ready_order();

  std::vector<std::string> names_;
  std::vector<at::Tensor> buffers_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> grad_views_;  // per parameter, aliasing its bucket
  std::vector<size_t> bucket_of_;
  std::vector<compat::NodePtr> accumulators_;
  std::shared_ptr<Reducer*> token_;  // hooks hold it weakly: no call after destruction

  std::mutex mu_;  // hooks run on autograd's threads
  bool armed_ = false;
  size_t next_launch_ = 0;
  std::vector<uint8_t> used_;  // got its gradient in this backward (bucket readiness)
  // Got a gradient in some backward since the last synced one (no_sync micro-batches
  // included): c10d's rule, a parameter used once in a no_sync session counts as used.
  std::vector<uint8_t> used_since_sync_;
  std::vector<uint8_t> grad_was_none_;  // .grad was undefined at some point this step
  std::vector<size_t> ready_order_;
  int64_t iteration_ = 0;
  bool rebuilt_ = false;
  bool training_forward_ = false;  // the running forward() has grad mode on
  std::exception_ptr hook_error_;  // a comm hook threw while issuing: collectives out of step
  Clock::time_point first_launch_;
  StepSync steps_;
  StepWire wire_;  // StepStats::wire: from a training forward's start to backward's end
};

DataParallel::Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
                               DataParallelOptions options)
    : module_(std::move(module)),
      comm_(std::move(comm)),
      options_(std::move(options)),
      steps_(comm_, "DataParallel", options_.step_checks),
      wire_({comm_}) {
  if (!comm_) throw InvalidArgument("DataParallel: communicator is null");
  if (!module_) throw InvalidArgument(ctx("DataParallel()"), "module is null");
  if (options_.bucket_cap_mb <= 0 || options_.first_bucket_cap_mb <= 0) {
    throw InvalidArgument(ctx("DataParallel()"), "bucket caps must be positive");
  }
  hook_ = options_.comm_hook ? options_.comm_hook : allreduce_hook();
  {
    std::vector<CommunicatorPtr> used = hook_->communicators();
    used.insert(used.begin(), comm_);
    wire_ = StepWire(std::move(used));
  }

  std::vector<std::pair<std::string, at::Tensor>> named;
  std::vector<at::Tensor> everything;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    named.emplace_back(item.key(), item.value());
    everything.push_back(item.value());
    if (item.value().requires_grad()) {
      names_.push_back(item.key());
      params_.push_back(item.value());
    }
  }
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
    named.emplace_back("buffer " + item.key(), item.value());
    everything.push_back(item.value());
    buffers_.push_back(item.value());
  }
  verify_same_model(*comm_, named, "DataParallel()");
  broadcast_from_rank0(*comm_, everything);

  used_.assign(params_.size(), 0);
  used_since_sync_.assign(params_.size(), 0);
  grad_was_none_.assign(params_.size(), 0);
  std::vector<size_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  build_buckets(order);

  token_ = std::make_shared<Reducer*>(this);
  std::weak_ptr<Reducer*> weak = token_;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = compat::grad_accumulator(params_[i]);
    compat::add_post_hook(acc, [weak, i] {
      if (auto self = weak.lock()) (*self)->on_grad_ready(i);
    });
    accumulators_.push_back(std::move(acc));
  }
}

void DataParallel::Reducer::build_buckets(const std::vector<size_t>& order) {
  c10::NoGradGuard no_grad;
  std::vector<int64_t> bytes(params_.size());
  std::vector<int> dtypes(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    bytes[i] = params_[i].numel() * static_cast<int64_t>(params_[i].element_size());
    // Buckets must not mix dtypes or devices: one id per (dtype, device).
    dtypes[i] = static_cast<int>(params_[i].scalar_type()) * 1024 +
                static_cast<int>(params_[i].device().type()) * 64 + params_[i].device().index() + 1;
  }
  auto mb = [](double m) { return static_cast<int64_t>(m * 1024 * 1024); };
  assignment_ = detail::assign_buckets(order, bytes, dtypes, mb(options_.first_bucket_cap_mb),
                                       mb(options_.bucket_cap_mb));
  buckets_.clear();
  grad_views_.assign(params_.size(), at::Tensor());
  bucket_of_.assign(params_.size(), 0);
  for (size_t b = 0; b < assignment_.size(); ++b) {
    Bucket bucket;
    bucket.params = assignment_[b];
    int64_t n = 0;
    for (size_t i : bucket.params) {
      bucket.offsets.push_back(n);
      n += params_[i].numel();
    }
    const at::Tensor& first = params_[bucket.params.front()];
    bucket.flat = at::zeros({n}, first.options().requires_grad(false));
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const size_t i = bucket.params[k];
      // Keep the parameter's own layout so AccumulateGrad can add into it in place.
      at::Tensor like = params_[i].is_contiguous() ? params_[i] : params_[i].contiguous();
      grad_views_[i] = alias_into(bucket.flat, bucket.offsets[k], like);
      if (params_[i].grad().defined()) {
        grad_views_[i].copy_(params_[i].grad());
      } else {
        grad_was_none_[i] = 1;
      }
      params_[i].mutable_grad() = grad_views_[i];
      bucket_of_[i] = b;
    }
    buckets_.push_back(std::move(bucket));
  }
}

void DataParallel::Reducer::ensure_grad_views() {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (g.defined() && g.data_ptr() == grad_views_[i].data_ptr()) continue;
    // zero_grad(set_to_none) or a user replaced .grad: bring the gradient back into its
    // bucket (zeros for none) so backward accumulates where communication reads.
    if (g.defined()) {
      grad_views_[i].copy_(g);
    } else {
      grad_views_[i].zero_();
      grad_was_none_[i] = 1;
    }
    params_[i].mutable_grad() = grad_views_[i];
  }
}

void DataParallel::Reducer::begin_forward(bool gradient_sync) {
  sync_ = gradient_sync;  // the bucket rebuild and a failed forward read it
  training_forward_ = c10::GradMode::is_enabled();
  // Before the step's first collective; an evaluation forward leaves the stats alone.
  if (training_forward_) wire_.start();
  steps_.start_step("forward");  // first: a rank that called finish() meets this one here
  try {
    if (iteration_ == 1 && options_.rebuild_buckets && !rebuilt_ && sync_) {
      rebuild_from_ready_order();
    }
    ensure_grad_views();
    if (options_.broadcast_buffers && !buffers_.empty()) broadcast_from_rank0(*comm_, buffers_);
  } catch (...) {
    std::rethrow_exception(steps_.break_with(
        "forward", "a collective at the start of the step failed", std::current_exception()));
  }
}

void DataParallel::Reducer::end_forward() {
  if (training_forward_) return;  // agreed at the end of backward()
  // An evaluation forward has no backward: its outcome is agreed here.
  if (auto failure = steps_.agree(StepSync::Point::kForwardEnd, "forward", nullptr)) {
    std::rethrow_exception(failure);
  }
}

void DataParallel::Reducer::forward_failed(std::exception_ptr error) {
  if (steps_.broken()) return;
  try {
    if (!training_forward_) {
      steps_.agree(StepSync::Point::kForwardEnd, "forward", error);
    } else {
      // The other ranks go on to backward(): issue what it issues, with this rank's
      // (dropped) buffers, so that every rank reaches the agreement.
      std::lock_guard<std::mutex> lock(mu_);
      armed_ = false;
      if (sync_) {
        stats_ = StepStats{};
        launch_order_.clear();
        next_launch_ = 0;
        for (auto& b : buckets_) b.pending = 0;
        std::vector<uint8_t> used;
        complete_communication(used);
      }
      if (!steps_.broken()) steps_.agree(StepSync::Point::kBackwardEnd, "forward", error);
    }
  } catch (...) {
    // broken: the sticky error is thrown by the next call; forward() rethrows `error` now
  }
  if (training_forward_) stats_.wire = wire_.finish();  // what the failed step sent
  if (!steps_.broken()) reset_after_failure();
}

void DataParallel::Reducer::rebuild_from_ready_order() {
  rebuilt_ = true;
  // Rank 0's observed order wins, so every rank builds identical buckets.
  std::vector<int64_t> order(params_.size());
  std::vector<uint8_t> seen(params_.size(), 0);
  size_t k = 0;
  for (size_t i : ready_order_) {
    if (!seen[i]) {
      order[k++] = static_cast<int64_t>(i);
      seen[i] = 1;
    }
  }
  for (size_t j = params_.size(); j-- > 0;) {  // parameters that never became ready
    if (!seen[j]) order[k++] = static_cast<int64_t>(j);
  }
  const std::vector<int64_t> rank0 = ControlPlane(*comm_).broadcast(order, 0);
  std::vector<size_t> agreed(rank0.begin(), rank0.end());
  build_buckets(agreed);
}

namespace {
constexpr const char* kOrderKey = "ddp/bucket_order";
constexpr const char* kIterationKey = "ddp/iteration";
constexpr const char* kRebuiltKey = "ddp/rebuilt";
}  // namespace

std::map<std::string, at::Tensor> DataParallel::Reducer::rank_state() const {
  std::map<std::string, at::Tensor> out;
  std::vector<int64_t> order;
  for (const auto& bucket : assignment_) order.insert(order.end(), bucket.begin(), bucket.end());
  out[kOrderKey] = at::tensor(order, at::kLong);
  out[kIterationKey] = at::full({1}, iteration_, at::kLong);
  out[kRebuiltKey] = at::full({1}, static_cast<int64_t>(rebuilt_), at::kLong);
  // Under the hook's name: state of another hook (the run changed hooks) is not handed over.
  const std::string prefix = "hook/" + hook_->name() + "/";
  for (const auto& [name, t] : hook_->state()) out[prefix + name] = t;
  return out;
}

void DataParallel::Reducer::load_rank_state(const std::map<std::string, at::Tensor>& state) {
  auto invalid = [&](const std::string& why) {
    throw InvalidArgument(ctx("load_rank_state"), why);
  };
  auto scalar = [&](const char* key) -> std::optional<int64_t> {
    auto it = state.find(key);
    if (it == state.end()) return std::nullopt;
    if (it->second.scalar_type() != at::kLong || it->second.numel() != 1) {
      invalid(fmt::format("\"{}\" must be one int64", key));
    }
    return it->second.item<int64_t>();
  };
  auto order_it = state.find(kOrderKey);
  if (order_it != state.end()) {
    const at::Tensor& t = order_it->second;
    if (t.scalar_type() != at::kLong || t.dim() != 1 ||
        t.numel() != static_cast<int64_t>(params_.size())) {
      invalid(
          fmt::format("\"{}\" must list the {} trainable parameters", kOrderKey, params_.size()));
    }
    const at::Tensor c = t.contiguous();
    std::vector<size_t> order;
    std::vector<uint8_t> seen(params_.size(), 0);
    for (int64_t k = 0; k < c.numel(); ++k) {
      const int64_t i = c.data_ptr<int64_t>()[k];
      if (i < 0 || i >= static_cast<int64_t>(params_.size()) || seen[static_cast<size_t>(i)]) {
        invalid(fmt::format("\"{}\" is not an order of the trainable parameters", kOrderKey));
      }
      seen[static_cast<size_t>(i)] = 1;
      order.push_back(static_cast<size_t>(i));
    }
    const auto iteration = scalar(kIterationKey);
    const auto rebuilt = scalar(kRebuiltKey);
    build_buckets(order);
    if (iteration) iteration_ = *iteration;
    if (rebuilt) rebuilt_ = *rebuilt != 0;
  }
  const std::string prefix = "hook/" + hook_->name() + "/";
  std::map<std::string, at::Tensor> hook_state;
  for (const auto& [name, t] : state) {
    if (name.compare(0, prefix.size(), prefix) == 0) hook_state[name.substr(prefix.size())] = t;
  }
  if (!hook_state.empty()) hook_->load_state(hook_state);
}

void DataParallel::Reducer::on_grad_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  used_since_sync_[i] = 1;  // before the armed check: no_sync backwards count too
  if (!armed_) return;
  if (iteration_ == 0) ready_order_.push_back(i);
  if (used_[i]) return;  // already counted this backward
  used_[i] = 1;
  Bucket& b = buckets_[bucket_of_[i]];
  if (--b.pending == 0) launch_ready_buckets();
}

void DataParallel::Reducer::launch_ready_buckets() {
  // Launch strictly in bucket order: every rank must issue the same collectives in the
  // same order, whatever order its gradients became ready in.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    if (next_launch_ == 0) first_launch_ = Clock::now();
    launch(next_launch_);
    ++next_launch_;
  }
}

void DataParallel::Reducer::launch(size_t b) {
  Bucket& bucket = buckets_[b];
  GradBucket gb;
  gb.index = static_cast<int>(b);
  gb.buffer = bucket.flat;
  for (size_t i : bucket.params) gb.parameters.push_back(params_[i]);
  gb.offsets = bucket.offsets;
  gb.is_last = b + 1 == buckets_.size();
  try {
    bucket.work = hook_->run(*comm_, gb);
  } catch (...) {
    // How many collectives the hook issued before throwing is unknown.
    hook_error_ = std::current_exception();
    throw;
  }
  launch_order_.push_back(static_cast<int>(b));
  stats_.bytes_communicated +=
      bucket.flat.numel() * static_cast<int64_t>(bucket.flat.element_size());
  stats_.num_collectives += 1;
}

std::exception_ptr DataParallel::Reducer::complete_communication(
    std::vector<uint8_t>& used_everywhere) {
  auto broken = [&](const std::string& why, std::exception_ptr cause) {
    std::rethrow_exception(steps_.break_with("backward", why, cause));
  };
  // Parameters that received no gradient leave their bucket pending: flush what is left,
  // still in order (their gradient region holds zeros or earlier accumulation).
  for (auto& b : buckets_) b.pending = 0;
  try {
    launch_ready_buckets();
  } catch (...) {
    broken("communication hook '" + hook_->name() + "' threw while issuing its collectives",
           std::current_exception());
  }
  std::exception_ptr failure;
  for (auto& b : buckets_) {
    try {
      b.work->wait();
    } catch (const CommError&) {
      broken(
          "a gradient collective failed (a rank that failed inside a communication hook, "
          "exited or ran out of data stops issuing them)",
          std::current_exception());
    } catch (...) {
      // The collective completed everywhere; a hook's continuation failed on this rank.
      if (!failure) failure = std::current_exception();
    }
  }
  if (options_.find_unused_parameters) {
    try {
      used_everywhere = ControlPlane(*comm_).all_reduce(used_since_sync_, ReduceOp::kMax);
    } catch (...) {
      broken("the unused-parameter all-reduce failed", std::current_exception());
    }
  }
  return failure;
}

void DataParallel::Reducer::backward(const at::Tensor& loss, bool gradient_sync) {
  sync_ = gradient_sync;
  steps_.check_usable("backward");
  ensure_grad_views();
  if (!wire_.started()) wire_.start();  // a loss computed outside forward()
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = StepStats{};
    launch_order_.clear();
    next_launch_ = 0;
    std::fill(used_.begin(), used_.end(), 0);
    for (auto& b : buckets_) {
      b.pending = static_cast<int>(b.params.size());
      b.work.reset();
    }
    armed_ = sync_;
  }
  std::exception_ptr failure;
  try {
    loss.backward();
  } catch (...) {
    failure = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  if (hook_error_) {
    std::rethrow_exception(steps_.break_with(
        "backward",
        "communication hook '" + hook_->name() + "' threw while issuing its collectives",
        hook_error_));
  }
  std::vector<uint8_t> used;
  const auto wait_start = Clock::now();
  if (sync_) {  // no_sync: gradients stay local, accumulated in the buckets
    if (auto hook_failure = complete_communication(used); hook_failure && !failure) {
      failure = hook_failure;
    }
  }
  const auto done = Clock::now();
  auto outcome = steps_.agree(StepSync::Point::kBackwardEnd, "backward", failure);
  stats_.wire = wire_.finish();
  if (outcome) {
    reset_after_failure();
    std::rethrow_exception(outcome);
  }
  if (!sync_) return;
  stats_.comm_wait_s = std::chrono::duration<double>(done - wait_start).count();
  stats_.comm_total_s = std::chrono::duration<double>(done - first_launch_).count();
  for (auto& b : buckets_) b.work.reset();
  if (options_.find_unused_parameters) apply_unused_parameters(used);
  std::fill(grad_was_none_.begin(), grad_was_none_.end(), 0);
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  ++iteration_;
}

void DataParallel::Reducer::apply_unused_parameters(const std::vector<uint8_t>& used_everywhere) {
  const auto& u = used_everywhere;
  for (size_t i = 0; i < params_.size(); ++i) {
    // Unused everywhere: leave .grad as single-device training would, undefined if the
    // optimizer had set it to none (LibTorch 2.x's zero_grad), zeros otherwise.
    if (u[i] == 0 && grad_was_none_[i]) params_[i].mutable_grad().reset();
  }
}

// A failed step leaves every gradient zero, as after zero_grad(); collectives of the step
// have all completed (they were waited for before the agreement).
void DataParallel::Reducer::reset_after_failure() {
  c10::NoGradGuard no_grad;
  armed_ = false;
  hook_error_ = nullptr;
  next_launch_ = 0;
  launch_order_.clear();
  std::fill(used_.begin(), used_.end(), 0);
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  std::fill(grad_was_none_.begin(), grad_was_none_.end(), 0);
  if (iteration_ == 0) ready_order_.clear();  // a partial order must not shape the buckets
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.work.reset();
    b.flat.zero_();
  }
}

void DataParallel::Reducer::finish() {
  steps_.check_usable("finish");
  steps_.finish();
}

at::Tensor DataParallel::Reducer::grad_norm() {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : params_) grads.push_back(p.grad());
  return squared_norm_sum(grads, comm_->device()).sqrt_();
}

int64_t DataParallel::Reducer::model_state_bytes(const std::vector<at::Tensor>& optimizer_state) {
  std::vector<at::Tensor> all = optimizer_state;
  for (const auto& p : module_->parameters()) {
    all.push_back(p);
    all.push_back(p.grad());
  }
  for (const auto& b : buckets_) all.push_back(b.flat);
  return tensor_bytes(all);
}

// --- DataParallel ---

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, CommunicatorPtr comm,
                           DataParallelOptions options)
    : reducer_(std::make_unique<Reducer>(std::move(module), std::move(comm), std::move(options))) {}

DataParallel::~DataParallel() = default;

void DataParallel::backward(const at::Tensor& loss) {
  reducer_->backward(loss, requires_gradient_sync());
}
std::vector<at::Tensor> DataParallel::parameters() { return reducer_->module_->parameters(); }
std::vector<NamedParameter> DataParallel::named_parameters() {
  return module_named_parameters(*reducer_->module_);
}
StateLayout DataParallel::state_layout() {
  StateLayout layout =
      replicated_state_layout(*reducer_->module_, reducer_->comm_, "replicated (ddp)");
  layout.rank_state = reducer_->rank_state();
  Reducer* reducer = reducer_.get();  // the layout is used while the strategy lives
  layout.load_rank_state = [reducer](const std::map<std::string, at::Tensor>& state) {
    reducer->load_rank_state(state);
  };
  // Broadcast buffers are rank 0's at the next forward anyway: the model entry suffices.
  if (!reducer_->options_.broadcast_buffers) keep_rank_buffers(layout);
  return layout;
}
double DataParallel::grad_norm() { return grad_norm_tensor().item<double>(); }
at::Tensor DataParallel::grad_norm_tensor() { return reducer_->grad_norm(); }
int64_t DataParallel::model_state_bytes(const std::vector<at::Tensor>& optimizer_state) {
  return reducer_->model_state_bytes(optimizer_state);
}
const StepStats& DataParallel::last_step_stats() const { return reducer_->stats_; }
int DataParallel::rank() const { return reducer_->comm_->rank(); }
int DataParallel::world_size() const { return reducer_->comm_->world_size(); }
void DataParallel::begin_forward() { reducer_->begin_forward(requires_gradient_sync()); }
void DataParallel::end_forward(at::Tensor& /*output*/) { reducer_->end_forward(); }
void DataParallel::forward_failed(std::exception_ptr error) noexcept {
  reducer_->forward_failed(std::move(error));
}
void DataParallel::finish() { reducer_->finish(); }
std::vector<int> DataParallel::last_launch_order() const { return reducer_->launch_order_; }

namespace detail {

std::vector<std::vector<size_t>> Inspect::bucket_assignment(const DataParallel& ddp) {
  return ddp.reducer_->assignment_;
}

}  // namespace detail

}  // namespace dtrain

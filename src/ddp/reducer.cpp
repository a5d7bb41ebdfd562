#include "ddp/reducer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <optional>

#include <fmt/format.h>

#include "comm/control_plane.h"
#include "dtrain/errors.h"
#include "strategy/inspect.h"
#include "strategy/step_driver.h"

namespace dtrain::ddp {
namespace {

// An alias of `flat`'s storage shaped like `like`, that autograd does not see as a view:
// optimizers may detach_() and zero_() it in place.
at::Tensor alias_into(const at::Tensor& flat, int64_t offset, const at::Tensor& like) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, like.sizes(), like.strides());
  return t;
}

constexpr const char* kOrderKey = "ddp/bucket_order";
constexpr const char* kIterationKey = "ddp/iteration";
constexpr const char* kRebuiltKey = "ddp/rebuilt";

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, CommunicatorPtr comm,
                 std::shared_ptr<CommHook> hook, ReducerOptions options, StepFailure& failure)
    : params_(std::move(params)),
      comm_(std::move(comm)),
      hook_(std::move(hook)),
      options_(options),
      failure_(failure) {
  used_.assign(params_.size(), 0);
  used_since_sync_.assign(params_.size(), 0);
  grad_was_none_.assign(params_.size(), 0);
  std::vector<size_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  build_buckets(order);
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.add(params_[i], [this, i] { on_grad_ready(i); });
  }
}

ErrorContext Reducer::ctx(const char* op) const {
  return ErrorContext{comm_->rank(), comm_->world_size(), op, -1};
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  c10::NoGradGuard no_grad;
  std::vector<int64_t> bytes(params_.size());
  std::vector<int> dtypes(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    bytes[i] = params_[i].numel() * static_cast<int64_t>(params_[i].element_size());
    // Buckets must not mix dtypes or devices: one id per (dtype, device).
    dtypes[i] = static_cast<int>(params_[i].scalar_type()) * 1024 +
                static_cast<int>(params_[i].device().type()) * 64 + params_[i].device().index() + 1;
  }
  assignment_ = detail::assign_buckets(order, bytes, dtypes, options_.first_bucket_cap_bytes,
                                       options_.bucket_cap_bytes);
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

void Reducer::ensure_grad_views() {
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

void Reducer::prepare_forward(bool gradient_sync) {
  if (iteration_ == 1 && options_.rebuild_buckets && !rebuilt_ && gradient_sync) {
    rebuild_from_ready_order();
  }
  ensure_grad_views();
}

void Reducer::rebuild_from_ready_order() {
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

std::map<std::string, at::Tensor> Reducer::rank_state() const {
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

void Reducer::load_rank_state(const std::map<std::string, at::Tensor>& state) {
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

void Reducer::on_grad_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  used_since_sync_[i] = 1;  // before the armed check: no_sync backwards count too
  if (!armed_) return;
  if (iteration_ == 0) ready_order_.push_back(i);
  if (used_[i]) return;  // already counted this backward
  used_[i] = 1;
  Bucket& b = buckets_[bucket_of_[i]];
  if (--b.pending == 0) launch_ready_buckets();
}

void Reducer::launch_ready_buckets() {
  // Launch strictly in bucket order: every rank must issue the same collectives in the
  // same order, whatever order its gradients became ready in.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    if (next_launch_ == 0) first_launch_ = Clock::now();
    launch(next_launch_);
    ++next_launch_;
  }
}

void Reducer::launch(size_t b) {
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
    failure_.out_of_step(std::current_exception());
    throw;
  }
  launch_order_.push_back(static_cast<int>(b));
  counters_.bytes_communicated +=
      bucket.flat.numel() * static_cast<int64_t>(bucket.flat.element_size());
  counters_.num_collectives += 1;
}

std::exception_ptr Reducer::complete_communication(std::vector<uint8_t>& used_everywhere) {
  // Parameters that received no gradient leave their bucket pending: flush what is left,
  // still in order (their gradient region holds zeros or earlier accumulation).
  for (auto& b : buckets_) b.pending = 0;
  try {
    launch_ready_buckets();
  } catch (...) {
    break_step("communication hook '" + hook_->name() + "' threw while issuing its collectives");
  }
  std::exception_ptr failure;
  for (auto& b : buckets_) {
    try {
      b.work->wait();
    } catch (const CommError&) {
      break_step(
          "a gradient collective failed (a rank that failed inside a communication hook, "
          "exited or ran out of data stops issuing them)");
    } catch (...) {
      // The collective completed everywhere; a hook's continuation failed on this rank.
      if (!failure) failure = std::current_exception();
    }
  }
  if (options_.find_unused_parameters) {
    try {
      used_everywhere = ControlPlane(*comm_).all_reduce(used_since_sync_, ReduceOp::kMax);
    } catch (...) {
      break_step("the unused-parameter all-reduce failed");
    }
  }
  return failure;
}

void Reducer::start_counting() {
  counters_ = StepStats{};
  launch_order_.clear();
  next_launch_ = 0;
}

void Reducer::issue_as_peers_do(bool gradient_sync) {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  if (!gradient_sync) return;  // a no_sync backward issues nothing
  start_counting();
  std::vector<uint8_t> used;
  // A hook's continuation failing on the dropped gradients changes nothing: the step fails.
  complete_communication(used);
}

std::exception_ptr Reducer::backward(const at::Tensor& loss, bool gradient_sync) {
  ensure_grad_views();
  {
    std::lock_guard<std::mutex> lock(mu_);
    start_counting();
    std::fill(used_.begin(), used_.end(), 0);
    for (auto& b : buckets_) {
      b.pending = static_cast<int>(b.params.size());
      b.work.reset();
    }
    armed_ = gradient_sync;
  }
  std::exception_ptr failure;
  try {
    loss.backward();
  } catch (...) {
    failure = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  if (failure_.state() == StepFailure::State::kOutOfStep) {
    throw StepBreak{
        "communication hook '" + hook_->name() + "' threw while issuing its collectives",
        failure_.out_of_step_cause()};
  }
  if (!gradient_sync) return failure;  // gradients stay local, accumulated in the buckets
  const auto wait_start = Clock::now();
  std::vector<uint8_t> used;
  if (auto hook_failure = complete_communication(used); hook_failure && !failure) {
    failure = hook_failure;
  }
  const auto done = Clock::now();
  counters_.comm_wait_s = std::chrono::duration<double>(done - wait_start).count();
  counters_.comm_total_s = std::chrono::duration<double>(done - first_launch_).count();
  used_everywhere_ = std::move(used);
  return failure;
}

void Reducer::commit(bool gradient_sync) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!gradient_sync) return;
  for (auto& b : buckets_) b.work.reset();
  if (options_.find_unused_parameters) apply_unused_parameters(used_everywhere_);
  std::fill(grad_was_none_.begin(), grad_was_none_.end(), 0);
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  ++iteration_;
}

void Reducer::apply_unused_parameters(const std::vector<uint8_t>& used_everywhere) {
  const auto& u = used_everywhere;
  for (size_t i = 0; i < params_.size(); ++i) {
    // Unused everywhere: leave .grad as single-device training would, undefined if the
    // optimizer had set it to none (LibTorch 2.x's zero_grad), zeros otherwise.
    if (u[i] == 0 && grad_was_none_[i]) params_[i].mutable_grad().reset();
  }
}

// The step's collectives have all completed (they were waited for before the agreement).
void Reducer::reset_after_failure() {
  c10::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
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

std::vector<at::Tensor> Reducer::bucket_buffers() const {
  std::vector<at::Tensor> out;
  for (const auto& b : buckets_) out.push_back(b.flat);
  return out;
}

StepStats Reducer::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

std::vector<int> Reducer::launch_order() const {
  std::lock_guard<std::mutex> lock(mu_);
  return launch_order_;
}

}  // namespace dtrain::ddp

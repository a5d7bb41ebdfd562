// Activation checkpointing as a custom autograd function (LibTorch's C++ frontend has none).
// Forward runs the function without grad mode and keeps only its inputs, the random
// generators' states and the autocast state; backward reruns it with grad mode on under
// those states and back-propagates through the recomputed graph (a reentrant backward, as
// PyTorch's use_reentrant checkpoint does).
#include "dtrain/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <memory>
#include <mutex>
#include <utility>

#include "compat/autocast.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The generators a recompute must replay: the CPU one and one per CUDA device of the inputs.
class RngStates {
 public:
  explicit RngStates(const std::vector<at::Tensor>& inputs) {
    generators_.push_back(at::detail::getDefaultCPUGenerator());
    for (const auto& t : inputs) {
      if (t.is_cuda()) {
        at::Generator g = at::globalContext().defaultGenerator(t.device());
        bool seen = false;
        for (const auto& h : generators_) seen = seen || h == g;
        if (!seen) generators_.push_back(g);
      }
    }
    states_ = capture();
  }
  // Runs fn with the generators as they were at construction; afterwards they continue from
  // where they were before the call.
  template <typename Fn>
  auto replay(Fn&& fn) {
    const std::vector<at::Tensor> now = capture();
    restore(states_);
    struct Restore {
      RngStates* self;
      const std::vector<at::Tensor>* now;
      ~Restore() { self->restore(*now); }
    } restore_after{this, &now};
    return fn();
  }

 private:
  std::vector<at::Tensor> capture() {
    std::vector<at::Tensor> out;
    for (auto& g : generators_) {
      std::lock_guard<std::mutex> lock(g.mutex());
      out.push_back(g.get_state());
    }
    return out;
  }
  void restore(const std::vector<at::Tensor>& states) {
    for (size_t i = 0; i < generators_.size(); ++i) {
      std::lock_guard<std::mutex> lock(generators_[i].mutex());
      generators_[i].set_state(states[i]);
    }
  }

  std::vector<at::Generator> generators_;
  std::vector<at::Tensor> states_;
};

// What backward needs besides the saved inputs; rides in the context as a capsule.
struct Recompute : torch::CustomClassHolder {
  CheckpointedFn fn;
  std::vector<bool> requires_grad;  // per input
  compat::AutocastState autocast;
  std::unique_ptr<RngStates> rng;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `anchor` requires grad so that the outputs always get this node, even when no input
  // requires grad but fn's parameters do (the first block fed by token ids).
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> recompute,
                               at::TensorList inputs, const at::Tensor& /*anchor*/) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    recompute->rng = std::make_unique<RngStates>(in);
    ctx->save_for_backward(in);
    std::vector<at::Tensor> out;
    {
      at::NoGradGuard no_grad;
      out = recompute->fn(in);
    }
    for (const auto& t : out) {
      if (!t.defined()) {
        throw InvalidArgument(ErrorContext{-1, -1, "checkpoint", -1},
                              "the checkpointed function returned an undefined tensor");
      }
    }
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(recompute));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = ctx->saved_data["recompute"].toCapsule();
    auto* recompute = static_cast<Recompute*>(holder.get());
    const variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      inputs.push_back(saved[i].detach().requires_grad_(recompute->requires_grad[i]));
    }
    const std::vector<at::Tensor> out = recompute->rng->replay([&] {
      compat::AutocastGuard autocast(recompute->autocast);
      at::AutoGradMode grad_mode(true);
      return recompute->fn(inputs);
    });
    if (out.size() != grads.size()) {
      throw Error(ErrorContext{-1, -1, "checkpoint", -1},
                  "the checkpointed function returned a different number of tensors when "
                  "recomputed; it must be deterministic");
    }
    variable_list roots, root_grads;
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].requires_grad() && grads[i].defined()) {
        roots.push_back(out[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    variable_list result;
    result.emplace_back();  // recompute (not a tensor)
    for (const auto& t : inputs) result.push_back(t.requires_grad() ? t.grad() : at::Tensor());
    result.emplace_back();  // anchor
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const CheckpointedFn& fn,
                                   const std::vector<at::Tensor>& inputs) {
  for (const auto& t : inputs) {
    if (!t.defined()) {
      throw InvalidArgument(ErrorContext{-1, -1, "checkpoint", -1}, "an input is undefined");
    }
  }
  if (!at::GradMode::is_enabled()) return fn(inputs);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->fn = fn;
  for (const auto& t : inputs) recompute->requires_grad.push_back(t.requires_grad());
  recompute->autocast = compat::AutocastState::current();
  const at::Tensor anchor = at::empty({0}).requires_grad_(true);
  return CheckpointFunction::apply(std::move(recompute), at::TensorList(inputs), anchor);
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input) {
  return checkpoint(
      [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
      {input})[0];
}

}  // namespace dtrain

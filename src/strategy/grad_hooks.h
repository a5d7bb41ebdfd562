// Gradient-ready hooks: a function run after autograd accumulates a parameter's gradient,
// the signal DDP's buckets and FSDP's units count down on. One owner per set of hooks.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "compat/torch_compat.h"

namespace dtrain {

class GradReadyHooks {
 public:
  GradReadyHooks() : token_(std::make_shared<char>(0)) {}
  // Hooks that fire after this (autograd may keep the accumulators) do nothing: declare it
  // after what the hooks' functions use, so that it goes first.
  ~GradReadyHooks() { token_.reset(); }
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;

  // Runs `on_ready` on autograd's thread each time `param`'s gradient has been accumulated
  // (also in no_sync backwards), while this object lives. Keeps the accumulator alive, so the
  // hook stays registered for as long as the parameter trains.
  void add(const at::Tensor& param, std::function<void()> on_ready) {
    auto acc = compat::grad_accumulator(param);
    compat::add_post_hook(acc, guard(std::move(on_ready)));
    accumulators_.push_back(std::move(acc));
  }

  // `fn` made safe to hand to autograd elsewhere (e.g. a tensor hook on a forward output): it
  // does nothing once this object is gone.
  std::function<void()> guard(std::function<void()> fn) const {
    std::weak_ptr<char> weak = token_;
    return [weak, fn = std::move(fn)] {
      if (auto alive = weak.lock()) fn();
    };
  }

 private:
  std::shared_ptr<char> token_;
  std::vector<compat::NodePtr> accumulators_;
};

}  // namespace dtrain

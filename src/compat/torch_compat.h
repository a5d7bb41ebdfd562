// The one place where dtrain adapts to differences between LibTorch releases
// (Debian's 1.13 and the 2.x shipped with Python's torch). Everything else in dtrain
// calls these helpers instead of version-specific APIs.
#pragma once

#include <torch/version.h>

#include <memory>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#define DTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace dtrain::compat {

// The autograd node that accumulates `param`'s gradient. Callers must keep the returned
// pointer alive as long as hooks on it should fire: the parameter holds it only weakly.
inline std::shared_ptr<torch::autograd::Node> grad_accumulator(const at::Tensor& param) {
  return torch::autograd::impl::grad_accumulator(param);
}

// Registers `fn` to run after `node` ran (for an AccumulateGrad node: after .grad was
// accumulated). The post-hook signature changed between 1.13 and 2.x; LambdaPostHook
// hides it in both.
template <typename Fn>
void add_post_hook(const std::shared_ptr<torch::autograd::Node>& node, Fn fn) {
  node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& /*inputs*/) {
        fn();
        return outputs;
      }));
}

}  // namespace dtrain::compat

// The one place where dtrain adapts to differences between LibTorch releases
// (Debian's 1.13 and the 2.x shipped with Python's torch). Everything else in dtrain
// calls these helpers instead of version-specific APIs.
#pragma once


#include <memory>
#include <sstream>
#include <string>
#include <type_traits>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

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

// Frees the memory behind `t`'s storage while keeping the storage object, which autograd's
// saved tensors and the module's parameter views share; refill_storage gives it fresh memory
// of `nbytes`. Uses the storage's own allocator, so it works for any device.
inline void release_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(static_cast<size_t>(0));
}

inline void refill_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

inline bool storage_is_released(const at::Tensor& t) { return t.storage().nbytes() == 0; }

// Key of `param`'s entry in torch::optim::Optimizer::state(): 1.13 keys the map by the
// TensorImpl's address printed as a string, later releases by the address itself.
template <typename StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap& /*state*/, const at::Tensor& param) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;  // what c10::guts::to_string does in 1.13
    out << param.unsafeGetTensorImpl();
    return out.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

}  // namespace dtrain::compat

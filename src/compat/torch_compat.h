// The one place where dtrain adapts to differences between LibTorch releases
// (Debian's 1.13 and the 2.x shipped with Python's torch). Everything else in dtrain
// calls these helpers instead of version-specific APIs.
#pragma once

#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

namespace dtrain::compat {

// An owning pointer to an autograd node: std::shared_ptr up to LibTorch 2.13,
// c10::intrusive_ptr from 2.14.
using NodePtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// The autograd node that accumulates `param`'s gradient. Callers must keep the returned
// pointer alive as long as hooks on it should fire: the parameter holds it only weakly.
inline NodePtr grad_accumulator(const at::Tensor& param) {
  return torch::autograd::impl::grad_accumulator(param);
}

// Registers `fn` to run after `node` ran (for an AccumulateGrad node: after .grad was
// accumulated). The post-hook signature changed between 1.13 and 2.x; LambdaPostHook
// hides it in both.
template <typename Fn>
void add_post_hook(const NodePtr& node, Fn fn) {
  node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& /*inputs*/) {
        fn();
        return outputs;
      }));
}

inline bool storage_is_released(const at::Tensor& t) { return t.storage().nbytes() == 0; }

// Moving the memory behind `t`'s storage out and in while keeping the storage object, which
// autograd's saved tensors and the module's parameter views share: take_storage returns the
// memory (the storage then has none), fill_storage gives it `data` of `nbytes` (from
// storage_allocator, the storage's own, so any device works, or reused: fsdp/buffer_pool.h).
inline at::DataPtr take_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  at::DataPtr old = s->set_data_ptr(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(static_cast<size_t>(0));
  return old;
}

inline void fill_storage(const at::Tensor& t, at::DataPtr data, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(std::move(data));
  s->set_nbytes(nbytes);
}

inline c10::Allocator& storage_allocator(const at::Tensor& t) {
  return *t.storage().unsafeGetStorageImpl()->allocator();
}

// Key of `param`'s entry in torch::optim::Optimizer::state(): 1.13 keys the map by the
// TensorImpl's address printed as a string, later releases by the address itself.
template <typename StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap& /*state*/,
                                                const at::Tensor& param) {
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

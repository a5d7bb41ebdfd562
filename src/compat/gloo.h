// Differences between the Gloo snapshots dtrain builds against (Debian bookworm's 2022 one,
// trixie's 2023 one and forky's 2025 one), in one place as src/compat/torch_compat.h does
// for LibTorch. Gloo has no version macro, so each helper picks the call that compiles.
#pragma once

#include <memory>
#include <utility>

namespace dtrain::compat {
namespace detail {

// Gloo from 2025: Context::connectFullMesh(std::shared_ptr<Store>, device).
template <typename Context, typename Store, typename Device>
auto connect_full_mesh(Context& context, const std::shared_ptr<Store>& store, Device& device,
                       int /*preferred*/) -> decltype(context.connectFullMesh(store, device)) {
  return context.connectFullMesh(store, device);
}

// Older Gloo: Context::connectFullMesh(Store&, device).
template <typename Context, typename Store, typename Device>
auto connect_full_mesh(Context& context, const std::shared_ptr<Store>& store, Device& device,
                       long /*fallback*/) -> decltype(context.connectFullMesh(*store, device)) {
  return context.connectFullMesh(*store, device);
}

}  // namespace detail

// Connects every pair of `context`'s ranks through `store` (a gloo::rendezvous::Store), which
// must stay alive until it returns.
template <typename Context, typename Store, typename Device>
void connect_full_mesh(Context& context, const std::shared_ptr<Store>& store, Device& device) {
  detail::connect_full_mesh(context, store, device, 0);
}

}  // namespace dtrain::compat

// Shared by the FSDP tests: the wrap policy with nested units, ranks as threads with hybrid
// groups, and the comparison of a full state dict with single-device training.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/fsdp.h"
#include "dtrain/store.h"
#include "support/check.h"

namespace dtrain::testing {

// Blocks are units; each block's `up` projection is a unit nested inside its block.
inline WrapPolicy blocks_and_nested_up() {
  return [](const std::string& name, const torch::nn::Module& m) {
    const bool is_up = name.size() >= 3 && name.compare(name.size() - 3, 3, ".up") == 0;
    return m.name().find("BlockImpl") != std::string::npos || is_up;
  };
}

// Runs `fn(world_comm, groups)` on `world` threads; hybrid groups of `group_size` (none
// when 0). Waits for all, then rethrows the first exception.
inline void run_with_groups(int world, int group_size,
                            const std::function<void(Communicator&, const HybridGroups&)>& fn) {
  auto store = make_memory_store();
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm = make_communicator(store, r, world);
        HybridGroups g;
        if (group_size > 0) g = make_hybrid_groups(store, r, world, group_size);
        fn(*comm, g);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// Every parameter of `ref` is in `state` (full_state_dict()) with the same shape and values.
inline void expect_state_matches(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                 const torch::nn::Module& ref, double rtol, double atol) {
  auto want = ref.named_parameters();
  size_t checked = 0;
  for (const auto& [name, t] : state) {
    if (!want.contains(name)) continue;
    const at::Tensor& w = want[name];
    DTRAIN_CHECK(t.sizes() == w.sizes(), "{}: shape", name);
    DTRAIN_CHECK(at::allclose(t, w, rtol, atol),
                 "parameter {} differs from single-device training: max |diff| {}", name,
                 (t - w).abs().max().item<double>());
    ++checked;
  }
  DTRAIN_CHECK(checked == want.size(), "full state dict has {} of {} parameters", checked,
               want.size());
}

}  // namespace dtrain::testing

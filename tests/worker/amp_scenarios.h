// Multi-process scenarios of the mixed-precision tests (tests/amp/), one rank each, run by
// dtrain_test_worker. Both train the tiny test transformer (tests/strategy/test_models.h)
// on a learnable task (predict each token id + 1; two global batches, alternating) with a
// global batch of kAmpGlobalBatch sequences split evenly over the ranks.
//
// "grad_scaler_<ddp|fsdp>": AdamW with a GradScaler (init scale 1024, growth interval 2) for
//   kScalerSteps steps; after backward of step kOverflowStep rank 1 writes inf into one
//   element of its first gradient (an overflow only that rank sees). Every rank writes one
//   line per step to `<out>.<rank>`:
//     <step> <scale after update> <growth_tracker> <skipped_steps> <found_inf> <stepped>
//     <sum of this rank's parameters (the optimizer's tensors) after the step, %.9g>
// "autocast_<single|ddp|fsdp>_<bf16|fp32>": AdamW for kAutocastSteps steps, the forward
//   under AutocastGuard(bf16 on CPU) or in fp32; rank 0 writes the per-step global mean loss
//   (one "%.9g" per line) to `<out>.loss` and the final full parameters (raw fp32, module
//   order) to `<out>.params`.
#pragma once

#include <string>

#include "dtrain/communicator.h"

namespace dtrain::testing {

constexpr int kScalerSteps = 6;
constexpr int kOverflowStep = 2;  // 0-based
constexpr int kAutocastSteps = 8;
constexpr int kAmpGlobalBatch = 4;

// Returns true when `scenario` is one of the above (and runs it); false otherwise.
bool run_amp_scenario(const std::string& scenario, const CommunicatorPtr& comm,
                      const std::string& out);

}  // namespace dtrain::testing

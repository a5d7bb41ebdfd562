// GradScaler: loss scaling for fp16 training (PyTorch's torch.cuda.amp.GradScaler), for every
// strategy.
//
// fp16 gradients of small magnitude underflow to zero. Multiplying the loss by a large scale
// S before backward multiplies every gradient by S and keeps them representable; dividing
// them by S before the optimizer restores their value. When S is too large a gradient
// overflows to inf (or becomes NaN): that step is skipped and S halved. After
// growth_interval steps without overflow S is doubled, so it stays close to the largest
// safe value.
//
// clang-format off
//   dtrain::GradScaler scaler(comm);                  // comm: every rank (null: one rank)
//   for (auto& batch : loader) {
//     opt.zero_grad();
//     at::Tensor loss = strategy->forward([&] { return loss_fn(model->forward(batch.x), batch.y); });
//     strategy->backward(scaler.scale(loss));         // gradients are S times too large
//     scaler.unscale(opt);                            // now true gradients; finds inf/NaN
//     strategy->clip_grad_norm(1.0);                  // clips true gradients
//     scaler.step(opt);                               // opt.step() unless inf/NaN was found
//     scaler.update();                                // halve or grow S
//   }
// clang-format on
//
// Every rank skips the same steps: unscale() all-reduces one value (the maximum of each
// rank's "found inf/NaN" flag) over `comm`, so an overflow that only one rank sees (its FSDP
// shard, its micro-batches under no_sync) skips the step everywhere, and every rank's scale
// stays identical. Gradient accumulation: scale every micro-batch's loss, unscale once per
// optimizer step.
//
// Each optimizer step moves through unscale -> step -> update, in that order
// (step() unscales first if unscale() was not called); another order throws InvalidArgument
// naming both stages.
//
// State for checkpoints: state_dict() / load_state_dict() (strings, for
// dtrain::TrainingState::values).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16, PyTorch's default
  // Dynamic scaling: multiply by backoff_factor on a step with inf/NaN, by growth_factor
  // after growth_interval consecutive steps without. With dynamic = false the scale stays
  // init_scale (a fixed loss scale); steps with inf/NaN are still skipped.
  bool dynamic = true;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// What a checkpoint holds of a scaler.
struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;  // consecutive steps without inf/NaN since the last change
  int64_t skipped_steps = 0;   // steps skipped so far (for reports)
};

class GradScaler {
 public:
  // comm: the ranks that must skip the same steps (all ranks of the job: under HYBRID FSDP
  // the world, not a shard group); null when training on one rank. Throws InvalidArgument
  // for a non-positive scale or interval, growth_factor <= 1 or backoff_factor outside (0, 1).
  explicit GradScaler(CommunicatorPtr comm = nullptr, GradScalerOptions options = {});

  // loss * scale, in fp32 (whatever the loss's dtype).
  at::Tensor scale(const at::Tensor& loss) const;

  // Divides the gradients of every parameter of `optimizer` by the scale and decides whether
  // any rank's gradients hold inf or NaN (collective: every rank calls it each step).
  // Returns true when the step must be skipped.
  bool unscale(torch::optim::Optimizer& optimizer);

  // optimizer.step() unless unscale() found inf/NaN; returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);

  // Adjusts the scale for the next step (see GradScalerOptions); ends the step.
  void update();

  double current_scale() const { return state_.scale; }
  // Whether this step's unscale() found inf/NaN on some rank (false before unscale()).
  bool found_inf() const { return found_inf_; }
  const GradScalerState& state() const { return state_; }
  // Restores a saved state (a resumed run); with dynamic = false the scale stays init_scale.
  // Throws InvalidArgument for a non-positive or non-finite scale or negative counts.
  void load_state(const GradScalerState& state);

  // The state as strings, keys "grad_scaler.scale" (exact: printed with 17 digits),
  // "grad_scaler.growth_tracker", "grad_scaler.skipped_steps".
  std::map<std::string, std::string> state_dict() const;
  // Reads what state_dict() wrote; throws InvalidArgument when a key is missing or malformed.
  void load_state_dict(const std::map<std::string, std::string>& values);

 private:
  enum class Stage { kIdle, kUnscaled, kStepped };
  static const char* name(Stage s);
  void expect(Stage want, const char* call) const;
  ErrorContext where(const std::string& op) const;

  CommunicatorPtr comm_;
  GradScalerOptions options_;
  GradScalerState state_;
  Stage stage_ = Stage::kIdle;
  bool found_inf_ = false;
};

}  // namespace dtrain

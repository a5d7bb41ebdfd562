#include "dtrain/grad_scaler.h"

#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "comm/control_plane.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

constexpr const char* kScaleKey = "grad_scaler.scale";
constexpr const char* kTrackerKey = "grad_scaler.growth_tracker";
constexpr const char* kSkippedKey = "grad_scaler.skipped_steps";

}  // namespace

ErrorContext GradScaler::where(const std::string& op) const {
  return ErrorContext{comm_ ? comm_->rank() : 0, comm_ ? comm_->world_size() : 1, op, -1};
}

GradScaler::GradScaler(CommunicatorPtr comm, GradScalerOptions options)
    : comm_(std::move(comm)), options_(options) {
  const GradScalerOptions& o = options_;
  if (!(o.init_scale > 0) || !std::isfinite(o.init_scale) || o.growth_interval < 1 ||
      !(o.growth_factor > 1) || !(o.backoff_factor > 0 && o.backoff_factor < 1)) {
    throw InvalidArgument(
        where("GradScaler()"),
        fmt::format("needs init_scale > 0 (got {}), growth_interval >= 1 (got {}), "
                    "growth_factor > 1 (got {}) and backoff_factor in (0, 1) (got {})",
                    o.init_scale, o.growth_interval, o.growth_factor, o.backoff_factor));
  }
  state_.scale = o.init_scale;
}

const char* GradScaler::name(Stage s) {
  switch (s) {
    case Stage::kIdle:
      return "idle (before unscale)";
    case Stage::kUnscaled:
      return "unscaled (before step)";
    case Stage::kStepped:
      return "stepped (before update)";
  }
  return "?";
}

void GradScaler::expect(Stage want, const char* call) const {
  if (stage_ == want) return;
  throw InvalidArgument(
      where(std::string("GradScaler.") + call),
      fmt::format("called in stage {}, needs stage {}: each optimizer step calls unscale(), "
                  "step(), update() in this order",
                  name(stage_), name(want)));
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  return loss.to(at::kFloat).mul(state_.scale);
}

bool GradScaler::unscale(torch::optim::Optimizer& optimizer) {
  expect(Stage::kIdle, "unscale()");
  c10::NoGradGuard no_grad;
  const double inv = 1.0 / state_.scale;
  // The sum of a gradient's elements in double is finite exactly when every element is:
  // fp32 values cannot overflow a double sum, and inf or NaN propagate. One reduction per
  // tensor, and a single host sync for the whole check (after the collective).
  at::Tensor sum;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      at::Tensor g = p.grad();
      if (!g.defined()) continue;
      g.mul_(inv);
      at::Tensor s = g.sum(at::kDouble);
      sum = sum.defined() ? sum.add_(s) : s;
    }
  }
  at::Tensor found = sum.defined() ? at::isfinite(sum).logical_not().to(at::kFloat).reshape({1})
                                   : at::full({1}, 0.0f);
  // On the communicator's device, wherever the gradients are (or without any on this rank).
  if (comm_ && comm_->world_size() > 1)
    found = ControlPlane(*comm_).all_reduce(found, ReduceOp::kMax);
  found_inf_ = found.item<float>() != 0.0f;
  stage_ = Stage::kUnscaled;
  return found_inf_;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (stage_ == Stage::kIdle) unscale(optimizer);
  expect(Stage::kUnscaled, "step()");
  stage_ = Stage::kStepped;
  if (found_inf_) {
    ++state_.skipped_steps;
    return false;
  }
  optimizer.step();
  return true;
}

void GradScaler::update() {
  expect(Stage::kStepped, "update()");
  stage_ = Stage::kIdle;
  if (!options_.dynamic) return;
  if (found_inf_) {
    state_.scale *= options_.backoff_factor;
    state_.growth_tracker = 0;
  } else if (++state_.growth_tracker == options_.growth_interval) {
    state_.scale *= options_.growth_factor;
    state_.growth_tracker = 0;
  }
}

void GradScaler::load_state(const GradScalerState& state) {
  if (!(state.scale > 0) || !std::isfinite(state.scale) || state.growth_tracker < 0 ||
      state.skipped_steps < 0) {
    throw InvalidArgument(where("GradScaler.load_state"),
                          fmt::format("invalid state: scale {}, growth_tracker {}, skipped {}",
                                      state.scale, state.growth_tracker, state.skipped_steps));
  }
  state_ = state;
  if (!options_.dynamic) state_.scale = options_.init_scale;  // a fixed scale is the flag's
  stage_ = Stage::kIdle;
  found_inf_ = false;
}

std::map<std::string, std::string> GradScaler::state_dict() const {
  return {{kScaleKey, fmt::format("{:.17g}", state_.scale)},
          {kTrackerKey, std::to_string(state_.growth_tracker)},
          {kSkippedKey, std::to_string(state_.skipped_steps)}};
}

void GradScaler::load_state_dict(const std::map<std::string, std::string>& values) {
  auto get = [&](const char* key) -> const std::string& {
    auto it = values.find(key);
    if (it == values.end()) {
      throw InvalidArgument(where("GradScaler.load_state_dict"),
                            std::string("no '") + key + "' in the saved state");
    }
    return it->second;
  };
  auto number = [&](const char* key) {
    const std::string& text = get(key);
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size()) {
      throw InvalidArgument(where("GradScaler.load_state_dict"),
                            fmt::format("'{}' is not a number: '{}'", key, text));
    }
    return v;
  };
  GradScalerState s;
  s.scale = number(kScaleKey);
  s.growth_tracker = static_cast<int64_t>(number(kTrackerKey));
  s.skipped_steps = static_cast<int64_t>(number(kSkippedKey));
  load_state(s);
}

}  // namespace dtrain

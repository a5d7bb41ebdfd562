#include "checkpoint/optimizer_state.h"

#include <ATen/ops/zeros_like.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <utility>

#include "compat/torch_compat.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint {

OptimizerAdapter::OptimizerAdapter(torch::optim::Optimizer* opt) : opt_(opt) {
  if (opt_ == nullptr) return;
  const auto& options = opt_->param_groups().at(0).options();
  if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    type_ = OptType::kAdamW;
    kinds_ = {"exp_avg", "exp_avg_sq"};
    if (o->amsgrad()) kinds_.push_back("max_exp_avg_sq");
  } else if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    type_ = OptType::kAdam;
    kinds_ = {"exp_avg", "exp_avg_sq"};
    if (a->amsgrad()) kinds_.push_back("max_exp_avg_sq");
  } else if (auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    type_ = OptType::kSgd;
    if (s->momentum() != 0) kinds_ = {"momentum_buffer"};
  } else {
    throw InvalidArgument(
        "checkpoint: unsupported optimizer (AdamW, Adam and SGD are supported); pass a null "
        "optimizer to save or load the model alone");
  }
}

const char* OptimizerAdapter::type_name() const {
  switch (type_) {
    case OptType::kAdamW:
      return "AdamW";
    case OptType::kAdam:
      return "Adam";
    case OptType::kSgd:
      return "SGD";
    case OptType::kNone:
      break;
  }
  return "none";
}

ParamOptState OptimizerAdapter::get(const at::Tensor& p) const {
  ParamOptState out;
  auto& state = opt_->state();
  auto it = state.find(compat::optimizer_state_key(state, p));
  if (it == state.end()) return out;
  out.present = true;
  auto defined_or_zeros = [&](const at::Tensor& t) {
    return t.defined() && t.numel() == p.numel() ? t : at::zeros_like(p);
  };
  if (type_ == OptType::kAdamW) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.step = s.step();
    out.tensors = {s.exp_avg(), s.exp_avg_sq()};
    if (kinds_.size() == 3) out.tensors.push_back(defined_or_zeros(s.max_exp_avg_sq()));
  } else if (type_ == OptType::kAdam) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
    out.step = s.step();
    out.tensors = {s.exp_avg(), s.exp_avg_sq()};
    if (kinds_.size() == 3) out.tensors.push_back(defined_or_zeros(s.max_exp_avg_sq()));
  } else if (!kinds_.empty()) {
    const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
    out.tensors = {defined_or_zeros(s.momentum_buffer())};
  }
  return out;
}

void OptimizerAdapter::set(const at::Tensor& p, ParamOptState s) const {
  auto& state = opt_->state();
  auto key = compat::optimizer_state_key(state, p);
  state.erase(key);
  if (!s.present) return;
  if (type_ == OptType::kAdamW) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(s.step);
    st->exp_avg(s.tensors[0]);
    st->exp_avg_sq(s.tensors[1]);
    if (kinds_.size() == 3) st->max_exp_avg_sq(s.tensors[2]);
    state[key] = std::move(st);
  } else if (type_ == OptType::kAdam) {
    auto st = std::make_unique<torch::optim::AdamParamState>();
    st->step(s.step);
    st->exp_avg(s.tensors[0]);
    st->exp_avg_sq(s.tensors[1]);
    if (kinds_.size() == 3) st->max_exp_avg_sq(s.tensors[2]);
    state[key] = std::move(st);
  } else {
    auto st = std::make_unique<torch::optim::SGDParamState>();
    if (!s.tensors.empty()) st->momentum_buffer(s.tensors[0]);
    state[key] = std::move(st);
  }
}

std::vector<double> OptimizerAdapter::learning_rates() const {
  std::vector<double> out;
  for (auto& g : opt_->param_groups()) out.push_back(g.options().get_lr());
  return out;
}

size_t OptimizerAdapter::group_count() const { return opt_->param_groups().size(); }

void OptimizerAdapter::set_learning_rates(const std::vector<double>& lrs) const {
  auto& groups = opt_->param_groups();
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lrs.at(i));
}

}  // namespace dtrain::checkpoint

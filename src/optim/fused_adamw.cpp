#include "dtrain/fused_adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "compat/foreach.h"
#include "compat/torch_compat.h"

namespace dtrain {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

// The step's scalars, computed in double and rounded to the parameter's type once, as
// AdamW's tensor operations round their Scalar arguments.
template <typename T>
struct Coefficients {
  T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bias_correction2, eps,
      neg_step_size;
};

template <typename T>
Coefficients<T> coefficients(const AdamWOptions& o, int64_t step) {
  const auto [beta1, beta2] = o.betas();
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  return {T(1 - o.lr() * o.weight_decay()),
          T(beta1),
          T(1 - beta1),
          T(beta2),
          T(1 - beta2),
          T(std::sqrt(bias_correction2)),
          T(o.eps()),
          T(-(o.lr() / bias_correction1))};
}

// AdamW's formula element by element, in the order its operations apply (see step()'s
// fallback): decay, moments, denominator, update. Memory-bound: each array is read once.
// Compiled with -fno-math-errno (CMake) so that the sqrt vectorizes.
template <typename T>
void update(T* p, const T* g, T* m, T* v, T* v_max, int64_t n, const Coefficients<T>& c,
            bool decay) {
  constexpr int64_t kGrain = 1 << 15;  // elements per task: 128 KiB of each array (float)
#ifdef _OPENMP
  // A no-op where LibTorch uses the same OpenMP runtime (Debian's); where it bundles its own
  // (pip wheels), the region below runs on ours, sized as LibTorch's intra-op threads.
  omp_set_num_threads(at::get_num_threads());
#endif
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T gi = g[i];
      const T pi = decay ? p[i] * c.decay : p[i];
      const T mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
      const T vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
      m[i] = mi;
      v[i] = vi;
      T second = vi;
      if (v_max != nullptr) {
        second = std::max(v_max[i], vi);
        v_max[i] = second;
      }
      const T denom = std::sqrt(second) / c.sqrt_bias_correction2 + c.eps;
      p[i] = pi + c.neg_step_size * (mi / denom);
    }
  });
}

bool one_pass(const at::Tensor& p, const at::Tensor& g, const AdamWParamState& s, bool amsgrad) {
  auto fits = [&](const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
           t.scalar_type() == p.scalar_type() && t.numel() == p.numel() && t.is_contiguous();
  };
  const bool dtype_ok = p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble;
  return dtype_ok && fits(p) && fits(g) && fits(s.exp_avg()) && fits(s.exp_avg_sq()) &&
         (!amsgrad || fits(s.max_exp_avg_sq()));
}

// A parameter on an accelerator whose update can join a multi-tensor one: a dense
// floating-point tensor whose gradient and state have its dtype, device and size and are
// contiguous (what the fused and foreach kernels take).
bool batchable(const at::Tensor& p, const at::Tensor& g, const AdamWParamState& s, bool amsgrad) {
  auto fits = [&](const at::Tensor& t) {
    return t.defined() && t.device() == p.device() && t.layout() == at::kStrided &&
           t.scalar_type() == p.scalar_type() && t.numel() == p.numel() && t.is_contiguous();
  };
  return !p.device().is_cpu() && at::isFloatingType(p.scalar_type()) && fits(p) && fits(g) &&
         fits(s.exp_avg()) && fits(s.exp_avg_sq()) && (!amsgrad || fits(s.max_exp_avg_sq()));
}

// The parameters of one multi-tensor update: one group's options, device, dtype, step.
struct Batch {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
};

// AdamW::step's operations for one parameter (LibTorch 1.13 and 2.x alike).
void reference_update(at::Tensor& p, const at::Tensor& g, AdamWParamState& s,
                      const AdamWOptions& o) {
  if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
  const auto [beta1, beta2] = o.betas();
  const double bias_correction1 = 1 - std::pow(beta1, s.step());
  const double bias_correction2 = 1 - std::pow(beta2, s.step());
  s.exp_avg().mul_(beta1).add_(g, 1 - beta1);
  s.exp_avg_sq().mul_(beta2).addcmul_(g, g, 1 - beta2);
  at::Tensor second = s.exp_avg_sq();
  if (o.amsgrad()) {
    at::max_out(s.max_exp_avg_sq(), s.exp_avg_sq(), s.max_exp_avg_sq());
    second = s.max_exp_avg_sq();
  }
  const at::Tensor denom = (second.sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  p.addcdiv_(s.exp_avg(), denom, -(o.lr() / bias_correction1));
}

}  // namespace

at::Tensor FusedAdamW::step(LossClosure closure) {
  c10::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const AdamWOptions&>(group.options());
    // Accelerator parameters: (device type, index, dtype, step) -> one multi-tensor update.
    std::map<std::tuple<int, int, int, int64_t>, Batch> batches;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& g = p.grad();
      TORCH_CHECK(!g.is_sparse(),
                  "AdamW does not support sparse gradients");  // AdamW's own message
      auto key = compat::optimizer_state_key(state_, p);
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto fresh = std::make_unique<AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) {
          fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        }
        it = state_.emplace(std::move(key), std::move(fresh)).first;
      }
      auto& s = static_cast<AdamWParamState&>(*it->second);
      s.step(s.step() + 1);
      if (batchable(p, g, s, options.amsgrad())) {
        Batch& b = batches[{static_cast<int>(p.device().type()), p.device().index(),
                            static_cast<int>(p.scalar_type()), s.step()}];
        b.params.push_back(p);
        b.grads.push_back(g);
        b.exp_avgs.push_back(s.exp_avg());
        b.exp_avg_sqs.push_back(s.exp_avg_sq());
        if (options.amsgrad()) b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
        continue;
      }
      if (!one_pass(p, g, s, options.amsgrad())) {
        reference_update(p, g, s, options);
        continue;
      }
      const bool decay = options.weight_decay() != 0;
      AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "FusedAdamW", [&] {
        update<scalar_t>(p.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(),
                         s.exp_avg().data_ptr<scalar_t>(), s.exp_avg_sq().data_ptr<scalar_t>(),
                         options.amsgrad() ? s.max_exp_avg_sq().data_ptr<scalar_t>() : nullptr,
                         p.numel(), coefficients<scalar_t>(options, s.step()), decay);
      });
    }
    const auto [beta1, beta2] = options.betas();
    for (auto& [key, b] : batches) {
      compat::adamw_step_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs,
                          {options.lr(), beta1, beta2, options.weight_decay(), options.eps(),
                           options.amsgrad(), std::get<3>(key)});
    }
  }
  return loss;
}

}  // namespace dtrain

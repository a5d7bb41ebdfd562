#include "amp_scenarios.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "dtrain/autocast.h"
#include "dtrain/data_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/grad_scaler.h"
#include "dtrain/single_device.h"
#include "strategy/test_models.h"

namespace dtrain::testing {
namespace {

constexpr int64_t kVocab = 50, kCtx = 8;

struct AmpBatch {
  at::Tensor x, y;
};

// Step s's global batch, one of two: random token ids, each target the id + 1 (learnable).
AmpBatch global_batch(int step) {
  at::manual_seed(1000 + step % 2);
  at::Tensor x = at::randint(0, kVocab, {kAmpGlobalBatch, kCtx});
  return {x, (x + 1).remainder(kVocab)};
}

std::shared_ptr<Strategy> make_strategy(const std::string& kind,
                                        const std::shared_ptr<torch::nn::Module>& module,
                                        const CommunicatorPtr& comm) {
  if (kind == "single") return std::make_shared<SingleDevice>(module);
  if (kind == "ddp") return std::make_shared<DataParallel>(module, comm);
  if (kind == "fsdp") {
    FsdpOptions o;
    o.wrap_policy = wrap_modules_named("BlockImpl");
    return std::make_shared<FullyShardedDataParallel>(module, comm, o);
  }
  throw std::runtime_error("unknown strategy " + kind);
}

// Mean cross-entropy in fp32 (the logits may be bf16 under autocast).
at::Tensor loss_of(TinyTransformer& model, const AmpBatch& b) {
  at::Tensor logits = model->forward(b.x);
  return at::cross_entropy_loss(logits.reshape({-1, kVocab}).to(at::kFloat), b.y.reshape({-1}));
}

AmpBatch local_rows(const AmpBatch& g, const Communicator& comm) {
  const int64_t rows = kAmpGlobalBatch / comm.world_size();
  return {g.x.narrow(0, comm.rank() * rows, rows), g.y.narrow(0, comm.rank() * rows, rows)};
}

std::FILE* open_or_throw(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot write " + path);
  return f;
}

void grad_scaler(const std::string& kind, const CommunicatorPtr& comm, const std::string& out) {
  at::manual_seed(7);
  TinyTransformer model(kVocab, kCtx, /*dim=*/16, /*heads=*/2, /*layers=*/2);
  auto strategy = make_strategy(kind, model.ptr(), comm);
  torch::optim::AdamW opt(strategy->parameters(), torch::optim::AdamWOptions(1e-2));
  GradScalerOptions so;
  so.init_scale = 1024;
  so.growth_interval = 2;
  GradScaler scaler(comm, so);
  std::FILE* f = open_or_throw(out + "." + std::to_string(comm->rank()));
  for (int s = 0; s < kScalerSteps; ++s) {
    opt.zero_grad();
    const AmpBatch b = local_rows(global_batch(s), *comm);
    at::Tensor loss = strategy->forward([&] { return loss_of(model, b); });
    strategy->backward(scaler.scale(loss));
    if (s == kOverflowStep && comm->rank() == 1) {
      at::Tensor g = strategy->parameters().front().grad();
      g.view({-1})[0].fill_(std::numeric_limits<float>::infinity());
    }
    scaler.unscale(opt);
    strategy->clip_grad_norm(1.0);
    const bool stepped = scaler.step(opt);
    scaler.update();
    double sum = 0;
    for (const auto& p : strategy->parameters()) sum += p.detach().sum().item<double>();
    const GradScalerState& st = scaler.state();
    std::fprintf(f, "%d %.17g %lld %lld %d %d %.9g\n", s, st.scale,
                 static_cast<long long>(st.growth_tracker),
                 static_cast<long long>(st.skipped_steps), scaler.found_inf() ? 1 : 0,
                 stepped ? 1 : 0, sum);
  }
  std::fclose(f);
  strategy->finish();
}

void autocast(const std::string& kind, bool bf16, const CommunicatorPtr& comm,
              const std::string& out) {
  at::manual_seed(7);
  TinyTransformer model(kVocab, kCtx, /*dim=*/32, /*heads=*/2, /*layers=*/2);
  {
    // GPT-2's embedding scale: with LibTorch's N(0, 1) the tied head's logits start huge.
    c10::NoGradGuard no_grad;
    model->wte->weight.normal_(0, 0.02);
    model->wpe->weight.normal_(0, 0.02);
  }
  auto strategy = make_strategy(kind, model.ptr(), comm);
  // eps well above round-off, as in tests/strategy/training.h: Adam turns a near-zero
  // gradient's rounding noise into full-size steps of either sign.
  torch::optim::AdamW opt(strategy->parameters(), torch::optim::AdamWOptions(1e-2).eps(1e-4));
  const Autocast amp{c10::DeviceType::CPU, c10::ScalarType::BFloat16};
  std::vector<double> losses;
  for (int s = 0; s < kAutocastSteps; ++s) {
    opt.zero_grad();
    const AmpBatch b = local_rows(global_batch(s), *comm);
    at::Tensor loss = strategy->forward([&] {
      std::optional<AutocastGuard> guard;
      if (bf16) guard.emplace(amp);
      return loss_of(model, b);
    });
    if (loss.scalar_type() != at::kFloat) throw std::runtime_error("the loss is not fp32");
    strategy->backward(loss);
    opt.step();
    at::Tensor mean = loss.detach().to(at::kDouble).reshape({1});
    if (comm->world_size() > 1) comm->all_reduce_sync(mean, ReduceOp::kAvg);
    losses.push_back(mean.item<double>());
  }
  std::vector<at::Tensor> params;
  if (auto* fsdp = dynamic_cast<FullyShardedDataParallel*>(strategy.get())) {
    for (auto& item : fsdp->full_state_dict()) params.push_back(item.second);
  } else {
    for (const auto& p : model->parameters()) params.push_back(p.detach());
  }
  strategy->finish();
  if (comm->rank() != 0) return;
  std::FILE* lf = open_or_throw(out + ".loss");
  for (double l : losses) std::fprintf(lf, "%.9g\n", l);
  std::fclose(lf);
  std::FILE* pf = open_or_throw(out + ".params");
  for (const auto& p : params) {
    at::Tensor t = p.to(at::kFloat).contiguous();
    std::fwrite(t.data_ptr<float>(), sizeof(float), static_cast<size_t>(t.numel()), pf);
  }
  std::fclose(pf);
}

}  // namespace

bool run_amp_scenario(const std::string& scenario, const CommunicatorPtr& comm,
                      const std::string& out) {
  const std::string scaler = "grad_scaler_", autocast_prefix = "autocast_";
  if (scenario.rfind(scaler, 0) == 0) {
    grad_scaler(scenario.substr(scaler.size()), comm, out);
    return true;
  }
  if (scenario.rfind(autocast_prefix, 0) == 0) {
    const std::string rest = scenario.substr(autocast_prefix.size());  // e.g. "ddp_bf16"
    const size_t cut = rest.rfind('_');
    if (cut == std::string::npos) return false;
    const std::string precision = rest.substr(cut + 1);
    if (precision != "bf16" && precision != "fp32") return false;
    autocast(rest.substr(0, cut), precision == "bf16", comm, out);
    return true;
  }
  return false;
}

}  // namespace dtrain::testing

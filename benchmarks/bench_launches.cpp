// dtrain_bench_launches: what one training step of the GPT-2 example model costs the host, as
// ATen operator calls (about one kernel launch each on a GPU) and, on the CPU, as time.
//
// The step is the one a user writes with dtrain on one device: zero the gradients (to none),
// forward and loss through SingleDevice, backward, clip the gradient norm at 1.0 on the
// device (clip_grad_norm_tensor), dtrain::FusedAdamW (betas 0.9/0.95, weight decay 0.1);
// fp32, attention through at::scaled_dot_product_attention where LibTorch has it, the token
// table's gradient dense (GptConfig::sparse_token_grad = false: the fake device has no sparse
// tensors; PyTorch's nn.Embedding is dense too).
//
//   --device fake: on the fake accelerator (tests/support/fake_device.h), the code path a
//     CUDA device takes (FusedAdamW's multi-tensor update, foreach norms), computed on the
//     CPU. Counts the outermost ATen calls of one steady-state step (tests/support/
//     op_counter.h: the events torch.profiler lists; backward's worker thread included) and
//     the host reads of device memory (HostReads): what benchmarks/launch-overhead.sh puts
//     next to PyTorch eager's count of the same step.
//   --device cpu: the same step on CPU tensors, timed: the median over --steps steps after
//     --warmup (the overhead-bound proxy with tiny widths).
// One JSON line on stdout.
//
//   dtrain_bench_launches --device fake --dim 768 --ctx 64          # GPT-2 124M's topology
//   dtrain_bench_launches --device cpu --dim 48 --ctx 64 --steps 50  # the proxy
#include <ATen/ATen.h>
#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/fused_adamw.h"
#include "dtrain/single_device.h"
#include "model.h"
#include "support/fake_device.h"
#include "support/op_counter.h"

ABSL_FLAG(std::string, device, "fake", "fake (count operators) | cpu (time the step)");
ABSL_FLAG(int64_t, layers, 12, "Transformer blocks (GPT-2 124M: 12)");
ABSL_FLAG(int64_t, heads, 12, "attention heads (GPT-2 124M: 12)");
ABSL_FLAG(int64_t, dim, 768, "model width (GPT-2 124M: 768)");
ABSL_FLAG(int64_t, ctx, 64, "sequence length");
ABSL_FLAG(int64_t, vocab, 50257, "vocabulary (GPT-2: 50257)");
ABSL_FLAG(int64_t, batch, 1, "sequences per step");
ABSL_FLAG(std::string, loss, "standard",
          "standard: logits then cross-entropy (as PyTorch's script) | fused: the example's "
          "chunked LM-head loss");
ABSL_FLAG(int64_t, warmup, 3, "steps before the counted or timed ones");
ABSL_FLAG(int64_t, steps, 1, "counted (fake) or timed (cpu) steps");
ABSL_FLAG(int, threads, 1, "intra-op threads");

namespace {

using Clock = std::chrono::steady_clock;

int run() {
  const std::string device_name = absl::GetFlag(FLAGS_device);
  if (device_name != "fake" && device_name != "cpu") {
    throw dtrain::InvalidArgument("--device must be fake or cpu, not '" + device_name + "'");
  }
  const std::string loss_name = absl::GetFlag(FLAGS_loss);
  if (loss_name != "standard" && loss_name != "fused") {
    throw dtrain::InvalidArgument("--loss must be standard or fused, not '" + loss_name + "'");
  }
  const int64_t warmup = absl::GetFlag(FLAGS_warmup), steps = absl::GetFlag(FLAGS_steps);
  if (warmup < 0 || steps < 1) throw dtrain::InvalidArgument("--warmup >= 0, --steps >= 1");
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  const bool fake = device_name == "fake";
  const c10::Device device = fake ? dtrain::testing::fake_device(0) : c10::Device(c10::kCPU);

  gpt2::GptConfig config;
  config.layers = absl::GetFlag(FLAGS_layers);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.dim = absl::GetFlag(FLAGS_dim);
  config.context = absl::GetFlag(FLAGS_ctx);
  config.vocab_size = absl::GetFlag(FLAGS_vocab);
  // The fake device has no sparse tensors: the token table's gradient is dense (as
  // torch.nn.Embedding's on PyTorch's side).
  config.sparse_token_grad = false;
  config.validate();
  at::manual_seed(1);
  auto model = std::make_shared<gpt2::GptImpl>(config);
  model->to(device);
  dtrain::SingleDeviceOptions options;
  options.device = device;
  auto strategy = std::make_shared<dtrain::SingleDevice>(model, options);
  dtrain::FusedAdamW opt(strategy->parameters(),
                         torch::optim::AdamWOptions(6e-4).betas({0.9, 0.95}).weight_decay(0.1));
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  const at::Tensor x =
      at::randint(config.vocab_size, {batch, config.context}, at::kLong).to(device);
  const at::Tensor y =
      at::randint(config.vocab_size, {batch, config.context}, at::kLong).to(device);
  const bool fused_loss = loss_name == "fused";
  at::Tensor last_loss;
  auto step = [&] {
    for (auto& p : strategy->parameters()) p.mutable_grad().reset();
    at::Tensor loss = strategy->forward([&] { return model->loss(x, y, fused_loss); });
    strategy->backward(loss);
    strategy->clip_grad_norm_tensor(1.0);
    opt.step();
    last_loss = loss.detach();
  };
  for (int64_t i = 0; i < warmup; ++i) step();

  std::string result;
  const std::string shape = fmt::format(
      "\"layers\": {}, \"heads\": {}, \"dim\": {}, \"ctx\": {}, \"vocab\": {}, "
      "\"batch\": {}, \"loss\": \"{}\", \"threads\": {}",
      config.layers, config.heads, config.dim, config.context, config.vocab_size, batch, loss_name,
      absl::GetFlag(FLAGS_threads));
  if (fake) {
    const dtrain::testing::HostReads before = dtrain::testing::host_reads();
    std::map<std::string, int64_t> by_name;
    {
      dtrain::testing::OpCounter count;
      for (int64_t i = 0; i < steps; ++i) step();
      by_name = count.by_name();
    }
    const dtrain::testing::HostReads reads = dtrain::testing::host_reads() - before;
    int64_t total = 0;
    std::string names;
    std::vector<std::pair<int64_t, std::string>> sorted;
    for (const auto& [name, n] : by_name) {
      total += n;
      sorted.emplace_back(-n, name);
    }
    std::sort(sorted.begin(), sorted.end());
    for (const auto& [n, name] : sorted) {
      names += fmt::format("{}\"{}\": {:g}", names.empty() ? "" : ", ", name,
                           static_cast<double>(-n) / static_cast<double>(steps));
    }
    result = fmt::format(
        "{{\"side\": \"dtrain\", \"device\": \"fake\", {}, \"ops_per_step\": {:g}, "
        "\"host_reads_per_step\": {:g}, \"by_name\": {{{}}}}}",
        shape, static_cast<double>(total) / static_cast<double>(steps),
        static_cast<double>(reads.total()) / static_cast<double>(steps), names);
  } else {
    std::vector<double> times;
    for (int64_t i = 0; i < steps; ++i) {
      const auto t0 = Clock::now();
      step();
      (void)last_loss.item<float>();  // as the PyTorch side reads its loss
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    const double median = times.size() % 2 == 1
                              ? times[times.size() / 2]
                              : (times[times.size() / 2 - 1] + times[times.size() / 2]) / 2;
    result = fmt::format(
        "{{\"side\": \"dtrain\", \"device\": \"cpu\", {}, \"steps\": {}, "
        "\"median_step_s\": {:.9f}, \"min_step_s\": {:.9f}, \"final_loss\": {:.6f}}}",
        shape, steps, median, times.front(), last_loss.item<double>());
  }
  std::printf("%s\n", result.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain_bench_launches: %s\n", e.what());
    return 1;
  }
}

// dtrain_bench_bucketing: DDP step time versus bucket_cap_mb on the GPT-2 example model.
//
// Bucket size trades per-collective latency (many small buckets) against overlap (one
// big bucket can only be launched when almost all of backward is done). Each benchmark
// trains the GPT-2 model (default: the `tiny` preset) with DataParallel and one
// bucket_cap_mb, one intra-op thread per rank, on uniform random tokens, with the loss
// (--loss, default fused) and AdamW as the example trainer uses them; an iteration is one
// optimizer step (forward, loss, backward with its bucketed all-reduce, optimizer step),
// timed on rank 0 between barriers.
// Warm-up steps run first, so the timed steps use the rebuilt (ready-order) buckets.
//
// Reported per bucket_cap_mb: the step time (manual time), tokens/s over all ranks,
// comm_total_ms (first bucket launch to last completion), comm_wait_ms (what the step
// waited after backward: the exposed part), hidden = 1 - wait/total, and the number of
// buckets. After the timed steps every rank's parameters must equal rank 0's bit for bit
// (DDP's invariant: the same averaged gradient everywhere); a difference fails the run.
//
//   dtrain_bench_bucketing --nproc=2 --bucket_cap_mb=0.25,1,5,25,100
#include <ATen/ATen.h>
#include <absl/flags/flag.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.h"
#include "dtrain/data_parallel.h"
#include "model.h"
#include "strategy/inspect.h"

ABSL_FLAG(std::string, model, "tiny", "GPT-2 preset of the example model: tiny | paper-27m | gpt2");
ABSL_FLAG(int64_t, vocab_size, 0, "override the preset's vocabulary (0: keep)");
ABSL_FLAG(int64_t, layers, 0, "override the preset's layers (0: keep)");
ABSL_FLAG(int64_t, dim, 0, "override the preset's width (0: keep)");
ABSL_FLAG(int64_t, heads, 0, "override the preset's heads (0: keep)");
ABSL_FLAG(int64_t, seq, 0, "tokens per sequence (0: the preset's context)");
ABSL_FLAG(int64_t, batch, 8, "sequences per rank per step");
ABSL_FLAG(std::string, bucket_cap_mb, "0.25,1,5,25,100",
          "comma-separated DataParallelOptions::bucket_cap_mb values, one benchmark each");
ABSL_FLAG(double, first_bucket_cap_mb, 1.0,
          "DataParallelOptions::first_bucket_cap_mb (capped at bucket_cap_mb)");
ABSL_FLAG(int64_t, warmup, 3, "untimed steps first (the buckets are rebuilt after the 1st)");
ABSL_FLAG(int64_t, steps, 10, "timed steps per bucket size (same on every rank)");
ABSL_FLAG(std::string, loss, "fused",
          "fused (the example's default, lm_head_loss.h) | standard (logits + cross_entropy)");
ABSL_FLAG(int64_t, corrupt_rank, -1,
          "testing hook: this rank perturbs a parameter before verification (must fail)");
ABSL_FLAG(bool, corrupt_reduction, false,
          "testing hook: every rank scales its reduced buckets by 1.001, a wrong reduction the "
          "ranks agree on (must fail the gradient check)");

namespace dtrain::bench {
namespace {

// The flags; constructed once the command line is parsed.
struct Config {
  std::string model = absl::GetFlag(FLAGS_model);
  int64_t vocab_size = absl::GetFlag(FLAGS_vocab_size);  // 0: the preset's
  int64_t layers = absl::GetFlag(FLAGS_layers);
  int64_t dim = absl::GetFlag(FLAGS_dim);
  int64_t heads = absl::GetFlag(FLAGS_heads);
  int64_t seq = absl::GetFlag(FLAGS_seq);  // 0: the model's context
  int64_t batch = absl::GetFlag(FLAGS_batch);
  std::string bucket_cap_mb = absl::GetFlag(FLAGS_bucket_cap_mb);
  double first_bucket_cap_mb = absl::GetFlag(FLAGS_first_bucket_cap_mb);
  int64_t warmup = absl::GetFlag(FLAGS_warmup);
  int64_t steps = absl::GetFlag(FLAGS_steps);
  std::string loss = absl::GetFlag(FLAGS_loss);
  bool corrupt_reduction = absl::GetFlag(FLAGS_corrupt_reduction);
  int64_t corrupt_rank = absl::GetFlag(FLAGS_corrupt_rank);
};

std::vector<double> parse_double_list(const std::string& text) {
  std::vector<double> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || !(v > 0)) {
      throw std::invalid_argument("not a positive number in a list: '" + item + "'");
    }
    values.push_back(v);
  }
  if (values.empty()) throw std::invalid_argument("empty list");
  return values;
}

gpt2::GptConfig model_config(const Config& cfg) {
  gpt2::GptConfig g = gpt2::preset(cfg.model);
  if (cfg.vocab_size > 0) g.vocab_size = cfg.vocab_size;
  if (cfg.layers > 0) g.layers = cfg.layers;
  if (cfg.dim > 0) g.dim = cfg.dim;
  if (cfg.heads > 0) g.heads = cfg.heads;
  if (cfg.seq > 0) g.context = cfg.seq;
  g.validate();
  return g;
}

// Bit-for-bit comparison of every parameter with rank 0's copy.
bool replicas_equal(Communicator& comm, const std::vector<at::Tensor>& params) {
  bool equal = true;
  for (const at::Tensor& p : params) {
    at::Tensor mine = p.detach().contiguous();
    at::Tensor root = mine.clone();
    comm.broadcast(root, 0)->wait();
    equal = equal && at::equal(mine, root);
  }
  return equal;
}

// Testing hook: the default average, then a scale every rank applies alike.
class ScaledAverageHook : public CommHook {
 public:
  WorkPtr run(Communicator& comm, GradBucket& bucket) override {
    at::Tensor b = bucket.buffer;
    return then(comm.all_reduce(b, ReduceOp::kAvg), [b]() mutable { b.mul_(1.001); });
  }
  std::string name() const override { return "scaled_average_for_test"; }
};

// DataParallel's bucketed gradients against a reference that shares none of its bucketing:
// this rank's local gradients (taken under no_sync) averaged one parameter at a time. Ranks
// agreeing with each other is not enough: a bucket offset or scale that is wrong the same
// way on every rank shows only here.
bool gradients_match_reference(Communicator& comm, DataParallel& ddp, gpt2::Gpt& model,
                               const at::Tensor& x, const at::Tensor& y, bool fused,
                               std::string* detail) {
  const auto params = ddp.parameters();
  auto backward = [&] {
    for (const auto& p : params) p.mutable_grad().reset();
    at::Tensor loss = ddp.forward([&] { return model->loss(x, y, fused); });
    ddp.backward(loss);
  };
  {
    auto guard = ddp.no_sync();
    backward();
  }
  std::vector<at::Tensor> reference;
  for (const auto& p : params) {
    at::Tensor g = p.grad().defined() ? p.grad().clone() : at::zeros_like(p);
    comm.all_reduce(g, ReduceOp::kAvg)->wait();
    reference.push_back(g);
  }
  backward();
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor g = params[i].grad().defined() ? params[i].grad() : at::zeros_like(params[i]);
    // Sums over ranks in another order: fp32 rounding only.
    if (!at::allclose(g, reference[i], /*rtol=*/1e-4, /*atol=*/1e-7)) {
      *detail = "parameter " + std::to_string(i) + ": max |diff| " +
                std::to_string((g - reference[i]).abs().max().item<double>());
      return false;
    }
  }
  return true;
}

void run(benchmark::State& state, const std::string& name, Communicator& comm, double cap_mb,
         const Config& cfg) {
  const gpt2::GptConfig g = model_config(cfg);
  at::manual_seed(1);  // the same initial weights for every bucket size
  gpt2::Gpt model(g);
  DataParallelOptions options;
  options.bucket_cap_mb = cap_mb;
  options.first_bucket_cap_mb = std::min(cfg.first_bucket_cap_mb, cap_mb);
  if (cfg.corrupt_reduction) options.comm_hook = std::make_shared<ScaledAverageHook>();
  // Non-owning: bench_main keeps the communicator alive until every benchmark has run.
  DataParallel ddp(std::static_pointer_cast<torch::nn::Module>(model.ptr()),
                   CommunicatorPtr(&comm, [](Communicator*) {}), options);
  torch::optim::AdamW opt(ddp.parameters(),
                          torch::optim::AdamWOptions(3e-4).betas({0.9, 0.95}).weight_decay(0.1));
  // Different tokens on each rank and step, drawn up front.
  at::manual_seed(1000 + static_cast<uint64_t>(comm.rank()));
  const int64_t T = g.context;
  const int64_t total = cfg.warmup + cfg.steps;
  at::Tensor tokens = at::randint(g.vocab_size, {total, cfg.batch, T + 1}, at::kLong);

  auto step = [&](int64_t i) {
    at::Tensor x = tokens[i].narrow(1, 0, T);
    at::Tensor y = tokens[i].narrow(1, 1, T);
    opt.zero_grad();
    at::Tensor loss = ddp.forward([&] { return model->loss(x, y, cfg.loss == "fused"); });
    ddp.backward(loss);
    opt.step();
  };
  for (int64_t i = 0; i < cfg.warmup; ++i) step(i);

  double step_s = 0, wait_s = 0, total_s = 0;
  int64_t i = cfg.warmup;
  for (auto _ : state) {
    comm.barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    step(i++);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt);
    step_s += dt;
    wait_s += ddp.last_step_stats().comm_wait_s;
    total_s += ddp.last_step_stats().comm_total_s;
  }

  if (comm.rank() == cfg.corrupt_rank) {  // test hook: must be caught
    at::NoGradGuard no_grad;
    ddp.parameters().front().view(-1)[0] += 1;
  }
  std::string failed;
  if (!all_ranks_ok(comm, replicas_equal(comm, ddp.parameters()), &failed)) {
    fail(state, comm, name,
         "verification failed: parameters differ from rank 0's on rank(s) " + failed);
    return;
  }
  std::string detail;
  const at::Tensor& last = tokens[total - 1];
  const bool grads_ok = gradients_match_reference(
      comm, ddp, model, last.narrow(1, 0, T), last.narrow(1, 1, T), cfg.loss == "fused", &detail);
  if (!all_ranks_ok(comm, grads_ok, &failed)) {
    fail(state, comm, name,
         "verification failed: reduced gradients differ from the per-parameter average on "
         "rank(s) " +
             failed + (detail.empty() ? "" : " (" + detail + ")"));
    return;
  }
  const double k = static_cast<double>(state.iterations());
  const double tokens_per_step = static_cast<double>(cfg.batch * T * comm.world_size());
  state.counters["bucket_cap_mb"] = cap_mb;
  state.counters["buckets"] = static_cast<double>(detail::Inspect::bucket_assignment(ddp).size());
  state.counters["comm_total_ms"] = total_s / k * 1e3;
  state.counters["comm_wait_ms"] = wait_s / k * 1e3;
  state.counters["hidden"] = total_s > 0 ? 1.0 - wait_s / total_s : 0.0;
  state.counters["tokens_per_s"] = tokens_per_step * k / step_s;
}

}  // namespace
}  // namespace dtrain::bench

int main(int argc, char** argv) {
  using namespace dtrain::bench;
  return bench_main(argc, argv, [](dtrain::Communicator& comm) {
    const Config cfg;  // from the flags, parsed by now
    if (cfg.batch < 1 || cfg.steps < 1 || cfg.warmup < 1) {
      throw std::invalid_argument("--batch, --steps and --warmup must be >= 1");
    }
    if (cfg.loss != "fused" && cfg.loss != "standard") {
      throw std::invalid_argument("--loss must be fused or standard");
    }
    if (!(cfg.first_bucket_cap_mb > 0)) {
      throw std::invalid_argument("--first_bucket_cap_mb must be > 0");
    }
    // Rejects a bad shape before any run; a shape changed by the overrides is named by it.
    const gpt2::GptConfig g = model_config(cfg);
    const bool overridden =
        cfg.vocab_size > 0 || cfg.layers > 0 || cfg.dim > 0 || cfg.heads > 0 || cfg.seq > 0;
    std::ostringstream model;
    model << cfg.model;
    if (overridden) {
      model << "(L" << g.layers << ",H" << g.heads << ",D" << g.dim << ",T" << g.context << ",V"
            << g.vocab_size << ")";
    }
    for (double cap : parse_double_list(cfg.bucket_cap_mb)) {
      std::ostringstream label;
      label << "ddp_step/ranks:" << comm.world_size() << "/model:" << model.str()
            << "/batch:" << cfg.batch << "/bucket_cap_mb:" << cap;
      const std::string name = label.str();
      register_benchmark(
          name, comm,
          [&comm, cfg, cap, name](benchmark::State& state) { run(state, name, comm, cap, cfg); })
          ->Iterations(cfg.steps)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  });
}

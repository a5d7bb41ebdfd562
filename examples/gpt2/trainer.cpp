// The training loop: run() -> train_epoch() -> train_step() -> micro_step().
#include "trainer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cuda_memory.h"
#include "metrics.h"
#include "progress.h"

namespace gpt2 {
namespace {

using Clock = std::chrono::steady_clock;

// --profile_out: steps run before profiling starts (allocator, caches and OpenMP pool warm).
constexpr int64_t kProfileWarmupSteps = 5;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Resets gradients to undefined, as LibTorch 2.x's zero_grad() does by default (1.13's fills
// them with zeros): backward then keeps each fresh gradient as it is instead of adding it to
// zeros. DataParallel points .grad back into its buckets before the next backward, and FSDP
// stores its reduced shard, so every strategy supports it.
void zero_grad_to_none(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad().reset();
  }
}

void set_learning_rate(torch::optim::AdamW& opt, double lr) {
  for (auto& group : opt.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

std::vector<at::Tensor> optimizer_state(torch::optim::AdamW& opt) {
  std::vector<at::Tensor> out;
  for (const auto& item : opt.state()) {
    const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(item.second.get());
    if (s == nullptr) continue;
    out.push_back(s->exp_avg());
    out.push_back(s->exp_avg_sq());
    out.push_back(s->max_exp_avg_sq());
  }
  return out;
}

}  // namespace

Trainer::Trainer(Config config, dtrain::LaunchInfo info, BlasSetup blas)
    : c_(std::move(config)),
      info_(std::move(info)),
      blas_(std::move(blas)),
      report_(info_.rank == 0) {}

void Trainer::run() {
  setup_process();
  setup_device_and_comm();
  setup_data();
  plan_memory();
  setup_model_and_strategy();
  setup_optimizer();
  const Schedule schedule = plan_schedule();

  RunLabels labels;
  labels.rank = info_.rank;
  labels.world_size = info_.world_size;
  labels.strategy = strategy_->name();
  if (comm_) labels.transport = comm_->transport_name();
  labels.blas = blas_label(blas_.info);
  labels.blas_kernel = blas_.info.kernel.empty() ? "unknown" : blas_.info.kernel;
  labels.cpu_bf16_native = blas_.cpu.native_bf16();
  if (const char* g = std::getenv("DTRAIN_GENERATION"); g != nullptr && *g != '\0') {
    labels.generation = std::atoll(g);
  }
  // Under a launcher's restarts every generation resumes and adds its lines to the file,
  // also a generation after the first that starts afresh (no checkpoint was complete yet):
  // the earlier generations' lines stay.
  const bool resuming =
      c_.resume && (!dtrain::latest_checkpoint(c_.ckpt_dir).empty() || labels.generation > 0);
  report_.start(std::move(labels), schedule.total_steps, schedule.epochs, c_.log_every,
                c_.metrics_out, resuming);
  if (rank0() && !c_.profile_out.empty()) op_profile_ = std::make_unique<OpProfile>();
  if (rank0() && !c_.trace_out.empty()) {
    trace_ = std::make_unique<KinetoTrace>(c_.trace_out, device_.is_cuda());
  }
  if (!c_.ckpt_dir.empty()) stop_.emplace();  // SIGTERM/SIGINT: checkpoint, then stop

  RunState run;
  run.start_step = run.step = c_.resume ? resume_step() : 0;
  if (c_.eval_only) {
    evaluate_only(run.step);
    return;
  }
  const auto run_start = Clock::now();
  for (int64_t epoch = run.start_step / schedule.steps_per_epoch; epoch < schedule.epochs;
       ++epoch) {
    train_epoch(schedule, epoch, run);
  }
  // Before finish(): under FSDP every rank runs the sample's forwards through the strategy.
  generate_sample();
  // Every rank, after its last batch: a rank with batches left makes every rank fail here
  // with a message naming the ranks (the split is even today; this keeps it checked).
  strategy_->finish();
  wait_for_checkpoint();  // --ckpt_async: the run ends with its last checkpoint written
  say(
      fmt::format("done: {} steps in {}; final loss {:.4f}, val_loss {:.4f}, grad_norm {:.3f}, "
                  "peak RSS {:.0f} MiB (max over ranks)",
                  run.step, format_duration(seconds_since(run_start)), run.last_loss, run.last_val,
                  run.last_grad_norm, run.max_rss));
  if (op_profile_ && op_profile_->steps() < c_.profile_steps) write_profile(schedule.total_steps);
  if (trace_ && trace_->recording()) write_trace(schedule.total_steps);
  if (!c_.export_path.empty()) export_weights();
  if (comm_ && info_.world_size > 1) comm_->barrier_sync();  // no rank leaves a peer waiting
}

// --eval_only: the loaded weights' validation loss and sample; no optimizer step, no
// checkpoint. `step` is the resumed checkpoint's (0 for --init_from).
void Trainer::evaluate_only(int64_t step) {
  if (c_.resume && step == 0) {
    throw dtrain::InvalidArgument(
        fmt::format("--eval_only --resume: no complete checkpoint in {} to evaluate", c_.ckpt_dir));
  }
  if (!val_sampler_) {
    throw dtrain::InvalidArgument(
        "--eval_only: the corpus has no validation split to evaluate on (see --val_fraction)");
  }
  const auto v0 = Clock::now();
  const double val_loss = validate();
  const double seconds = seconds_since(v0);
  report_.write_eval(step, val_loss, seconds);
  generate_sample();
  if (comm_ && info_.world_size > 1) comm_->barrier_sync();  // no rank leaves a peer waiting
}

// The epoch's steps (from where a resumed run stands), then its validation and summary.
void Trainer::train_epoch(const Schedule& schedule, int64_t epoch, RunState& run) {
  train_sampler_->set_epoch(epoch);
  const auto epoch_start = Clock::now();
  EpochTotals totals;
  const int64_t spe = schedule.steps_per_epoch;
  const int64_t first = epoch == run.start_step / spe ? run.start_step % spe : 0;
  for (int64_t s = first; s < spe && run.step < schedule.total_steps; ++s) {
    StepRecord r = train_step(schedule, epoch, s, run.step);
    run.step = r.step;
    run.last_loss = r.loss;
    run.last_grad_norm = r.grad_norm;
    run.max_rss = std::max(run.max_rss, r.peak_rss_mib());
    totals.add(r);
    report_.show_step(r);
    // Mid-epoch validation (--val_every); the epoch's end always validates below.
    const bool ends_epoch = s + 1 == spe || run.step == schedule.total_steps;
    if (c_.val_every > 0 && run.step % c_.val_every == 0 && !ends_epoch) {
      const auto v0 = Clock::now();
      r.val_loss = run.last_val = validate();
      totals.add_validation_time(seconds_since(v0));
      say(fmt::format("step {}: val_loss {:.4f}", run.step, *r.val_loss));
    }
    report_.write_step(r);
    checkpoint_or_stop(r, schedule.total_steps);
  }
  const double epoch_time = seconds_since(epoch_start) - totals.validation_time_s();
  const auto v0 = Clock::now();
  EpochRecord e = totals.record(epoch + 1, schedule.epochs, epoch_time);
  e.step = run.step;
  e.val_loss = run.last_val = validate();
  e.validation_time_s = seconds_since(v0);
  report_.write_epoch(e);
}

// One optimizer step: --grad_accum micro-batches, the gradient norm (and clipping), the
// update; then the all-gather of what rank 0 reports. Returns the step's record.
StepRecord Trainer::train_step(const Schedule& schedule, int64_t epoch, int64_t index_in_epoch,
                               int64_t step) {
  StepRecord r;
  r.step = step + 1;
  r.epoch = epoch + 1;
  r.tokens = schedule.tokens_per_step;
  r.lr = learning_rate(c_, step, schedule.total_steps);
  set_learning_rate(*optimizer_, r.lr);
  // --profile_out: record this step's operators, between the same two clock reads as
  // step_time (the recorder is set up before t0 and removed after the step is timed).
  const bool in_window =
      step >= kProfileWarmupSteps && step < kProfileWarmupSteps + c_.profile_steps;
  const bool profiled = op_profile_ && in_window;
  std::optional<OpRecorder> recorder;
  if (profiled) recorder.emplace(*op_profile_);
  // --trace_out: from the window's first step to its last (or the run's end).
  if (trace_ && in_window && step == kProfileWarmupSteps) trace_->start();
  const auto t0 = Clock::now();

  zero_grad_to_none(*optimizer_);
  // The loss and the gradient norm stay on the device until the step's work is queued: a
  // host read in between would make the host wait for the device before its next launch.
  at::Tensor local_loss;
  for (int64_t m = 0; m < c_.grad_accum; ++m) {
    const at::Tensor loss =
        micro_step(index_in_epoch * c_.grad_accum + m, m + 1 == c_.grad_accum, r)
            .div(static_cast<double>(c_.grad_accum));
    local_loss = m == 0 ? loss : local_loss.add(loss);
  }
  if (scaler_) {  // true gradients before clipping; every rank agrees on inf/NaN
    r.loss_scale = scaler_->current_scale();
    // The agreement goes over the world's communicator, outside the strategy's steps.
    const bool agrees = comm_ && info_.world_size > 1;
    const dtrain::WireStats before = agrees ? dtrain::wire_stats(*comm_) : dtrain::WireStats{};
    scaler_->unscale(*optimizer_);
    if (agrees) r.wire += dtrain::wire_stats(*comm_).since(before);
  }
  const at::Tensor grad_norm =
      c_.clip > 0 ? strategy_->clip_grad_norm_tensor(c_.clip) : strategy_->grad_norm_tensor();
  // The last micro-batch's bytes on the wire, now with the norm's all-reduce (FSDP).
  r.wire += strategy_->last_step_stats().wire;
  if (scaler_) {
    r.skipped = !scaler_->step(*optimizer_);
    scaler_->update();
  } else {
    optimizer_->step();
  }
  // One host read for both, queued after the optimizer's kernels.
  const at::Tensor values =
      at::stack({local_loss.to(grad_norm.device(), at::kDouble), grad_norm.to(at::kDouble)}).cpu();
  sync_device();
  r.grad_norm = values[1].item<double>();

  r.step_time_s = seconds_since(t0);
  recorder.reset();
  if (profiled) {
    op_profile_->add_step(r.step_time_s);
    if (op_profile_->steps() == c_.profile_steps) write_profile(schedule.total_steps);
  }
  if (trace_ && trace_->recording() && step + 1 == kProfileWarmupSteps + c_.profile_steps) {
    write_trace(schedule.total_steps);
  }
  gather_rank_values(values[0].item<double>(), r);
  check(std::isfinite(r.loss), fmt::format("loss is {} at step {}", r.loss, r.step));
  return r;
}

// Forward and backward of one micro-batch; adds its communication to `record` (the last
// micro-batch's bytes on the wire after the gradient norm: train_step) and returns its loss
// (detached, on the device: not read here).
// Only the step's last micro-batch communicates gradients: the others accumulate locally
// (Strategy::set_requires_gradient_sync; DDP in its buckets, FSDP unsharded).
at::Tensor Trainer::micro_step(int64_t micro_batch, bool last, StepRecord& record) {
  Batch b = task_->load_batch(train_tokens_, *train_sampler_, micro_batch);
  // The batch's sequences, as the sampler gave them to load_batch: the metrics' digest.
  for (int64_t offset : train_sampler_->rank_offsets(micro_batch)) {
    record.samples += 1;
    record.samples_hash += sample_digest(offset / train_sampler_->options().seq_len);
  }
  at::Tensor x = b.inputs.to(device_), y = b.targets.to(device_);
  strategy_->set_requires_gradient_sync(last);
  at::Tensor loss = strategy_->forward([&] { return model_loss(x, y); });
  const at::Tensor value = loss.detach().to(at::kDouble);  // as the host double it was
  if (c_.grad_accum > 1) loss = loss / static_cast<double>(c_.grad_accum);
  strategy_->backward(scaler_ ? scaler_->scale(loss) : loss);
  const dtrain::StepStats& stats = strategy_->last_step_stats();
  record.comm_wait_s += stats.comm_wait_s;
  record.comm_total_s += stats.comm_total_s;
  record.num_collectives += stats.num_collectives;
  if (!last) record.wire += stats.wire;
  return value;
}

// The model's loss (fp32), under autocast with --precision bf16/fp16 for single and ddp.
at::Tensor Trainer::model_loss(const at::Tensor& x, const at::Tensor& y) {
  std::optional<dtrain::AutocastGuard> amp;
  if (autocast_) amp.emplace(*autocast_);
  return task_->loss(x, y, c_.fused_loss());
}

// One all-gather of each rank's loss, peak RSS, model state, stop signal (every rank then
// knows whether any rank was asked to stop), CUDA peak (-1: none) and samples (count and
// digest).
void Trainer::gather_rank_values(double local_loss, StepRecord& r) {
  const double state_mib =
      static_cast<double>(strategy_->model_state_bytes(optimizer_state(*optimizer_))) / kMiB;
  std::optional<double> cuda_peak;
  if (device_.is_cuda()) cuda_peak = cuda_peak_mib(device_.index());
  std::vector<double> mine = {local_loss,
                              peak_rss_mib(),
                              state_mib,
                              static_cast<double>(stop_signal()),
                              cuda_peak.value_or(-1),
                              static_cast<double>(r.samples),
                              static_cast<double>(r.samples_hash)};
  // This rank's bytes on the wire (exact in a double up to 2^53 bytes); summed below.
  const std::vector<double> wire = wire_values(r.wire);
  mine.insert(mine.end(), wire.begin(), wire.end());
  r.stop_signal = stop_signal();
  const int world = info_.world_size;
  std::vector<double> all = mine;
  if (comm_ && world > 1) {
    const auto n = static_cast<int64_t>(mine.size());
    // Control values go on the communicator's device (the model's may differ, e.g. CUDA
    // under a CPU Gloo communicator).
    at::Tensor in = at::tensor(mine, at::TensorOptions().dtype(at::kDouble)).to(comm_->device());
    at::Tensor out = at::empty({world * n}, in.options());
    comm_->all_gather_sync(out, in);
    out = out.cpu();
    all.assign(out.data_ptr<double>(), out.data_ptr<double>() + world * n);
  }
  double loss_sum = 0, samples = 0, samples_hash = 0;
  r.wire = dtrain::WireStats{};
  for (size_t i = 0; i < all.size(); i += mine.size()) {
    add_wire_values(r.wire, &all[i + mine.size() - kWireValues]);
    loss_sum += all[i];
    r.peak_rss_mib_per_rank.push_back(all[i + 1]);
    r.model_state_mib_per_rank.push_back(all[i + 2]);
    r.stop_signal = std::max(r.stop_signal, static_cast<int>(all[i + 3]));
    if (all[i + 4] >= 0) r.cuda_peak_mib_per_rank.push_back(all[i + 4]);
    samples += all[i + 5];
    samples_hash += all[i + 6];
  }
  r.samples = static_cast<int64_t>(samples);
  r.samples_hash = static_cast<int64_t>(samples_hash);
  r.loss = loss_sum / static_cast<double>(r.peak_rss_mib_per_rank.size());
}

// Mean loss over (up to) val_batches global batches of the validation split; every rank
// evaluates its rows of each batch, in step with the others.
double Trainer::validate() {
  if (!val_sampler_) return std::nan("");
  c10::NoGradGuard no_grad;
  int64_t n = val_sampler_->steps_per_epoch();
  if (c_.val_batches > 0) n = std::min(n, c_.val_batches);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    Batch b = task_->load_batch(val_tokens_, *val_sampler_, i);
    at::Tensor x = b.inputs.to(device_), y = b.targets.to(device_);
    at::Tensor loss = strategy_->forward([&] { return model_loss(x, y); });
    sum += loss.item<double>();
  }
  double mean = sum / static_cast<double>(std::max<int64_t>(n, 1));
  if (comm_ && info_.world_size > 1) {
    at::Tensor t = at::full({1}, mean, at::TensorOptions().dtype(at::kDouble)).to(comm_->device());
    comm_->all_reduce_sync(t, dtrain::ReduceOp::kAvg);
    mean = t.item<double>();
  }
  return mean;
}

// Rank 0 with --profile_out: once the profiled steps are done, or at the end of a run too
// short for all of them.
void Trainer::write_profile(int64_t total_steps) {
  op_profile_->write_json(c_.profile_out);
  const int64_t n = op_profile_->steps();
  if (n < c_.profile_steps) {
    say(
        fmt::format("profile: only {} of --profile_steps {} steps profiled (the run has {} steps, "
                    "the first {} are warm-up); wrote {}",
                    n, c_.profile_steps, total_steps, kProfileWarmupSteps, c_.profile_out));
  } else {
    say(fmt::format("profile: {} steps, {:.3f} s/step, written to {}", n,
                    op_profile_->wall_s() / static_cast<double>(n), c_.profile_out));
  }
}

// Rank 0 with --trace_out: after the window's last step, or at the end of a shorter run.
void Trainer::write_trace(int64_t total_steps) {
  const std::size_t events = trace_->stop();
  say(fmt::format(
      "trace: {} events of steps {} to {} (of {}), written to {}", events, kProfileWarmupSteps + 1,
      std::min(kProfileWarmupSteps + c_.profile_steps, total_steps), total_steps, trace_->path()));
}

void Trainer::sync_device() {
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
}

}  // namespace gpt2

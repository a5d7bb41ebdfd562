// Checkpoints (--ckpt_dir, --resume: docs/checkpoints.md) and the weights export (--export).
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "dtrain/checkpoint.h"
#include "hf_weights.h"
#include "metrics.h"
#include "trainer.h"

namespace gpt2 {

// --resume: the step to continue from (0 when --ckpt_dir holds no complete checkpoint).
int64_t Trainer::resume_step() {
  const std::string latest = dtrain::latest_checkpoint(c_.ckpt_dir);
  if (latest.empty()) {
    say(fmt::format("resume: no checkpoint in {}, starting fresh", c_.ckpt_dir));
    return 0;
  }
  dtrain::CheckpointStats stats;
  const dtrain::TrainingState state =
      dtrain::load_checkpoint(latest, *strategy_, optimizer_.get(), {}, &stats);
  // The data position is the step: step x global batch sequences of the epoch's order were
  // read. Another global batch would continue from another sample (and another LR schedule).
  const int64_t global_batch = c_.batch * info_.world_size * c_.grad_accum;
  if (auto it = state.values.find("global_batch");
      it != state.values.end() && it->second != std::to_string(global_batch)) {
    throw dtrain::InvalidArgument(fmt::format(
        "--resume: {} was written at a global batch of {} sequences, this run's is {} (--batch "
        "{} x {} ranks x --grad_accum {}): the data order would not continue from the "
        "checkpoint's sample. Keep the global batch: --global_batch {} (docs/multinode.md, "
        "\"Elastic runs\")",
        latest, it->second, global_batch, c_.batch, info_.world_size, c_.grad_accum, it->second));
  }
  say(fmt::format("resume: step {} from {} ({:.1f} MiB read in {:.2f} s on rank 0)", state.step,
                  latest, static_cast<double>(stats.bytes) / kMiB, stats.seconds));
  if (c_.comm_hook == CommHookKind::kPowerSgd) {
    // Error buffers and Q differ per rank; the checkpoint format has no per-rank tensors yet.
    say(
        fmt::format("resume: PowerSGD's state (error feedback, Q) is not in checkpoints: it "
                    "starts afresh, with {} plain all-reduce steps",
                    c_.powersgd_start_iter));
  }
  if (scaler_) {
    if (state.values.count("grad_scaler.scale") != 0) {
      scaler_->load_state_dict(state.values);
      say(fmt::format("resume: loss scale {}", scaler_->current_scale()));
    } else {
      say(fmt::format("resume: the checkpoint holds no loss scale; starting at {}",
                      scaler_->current_scale()));
    }
  }
  return state.step;
}

// Checkpoints: every --ckpt_every steps, after the last step, and when a rank got
// SIGTERM/SIGINT (all ranks learnt it from the step's all-gather, so they stop at the same
// step); then the stop itself, as an exception.
void Trainer::checkpoint_or_stop(const StepRecord& r, int64_t total_steps) {
  const bool every = c_.ckpt_every > 0 && r.step % c_.ckpt_every == 0;
  std::string saved;
  if (!c_.ckpt_dir.empty() && (every || r.step == total_steps || r.stop_signal != 0)) {
    saved = save_checkpoint(r.step);
  }
  if (r.stop_signal != 0) wait_for_checkpoint();  // written before the run says so
  if (r.stop_signal != 0) {
    throw std::runtime_error(
        fmt::format("stopped by {} after step {}: {}", strsignal(r.stop_signal), r.step,
                    saved.empty() ? std::string("no checkpoint written (no --ckpt_dir)")
                                  : "checkpoint written to " + saved + "; continue with --resume"));
  }
}

std::string Trainer::save_checkpoint(int64_t step) {
  if (!checkpointer_) {
    dtrain::CheckpointOptions o;
    o.format = c_.ckpt_format;
    o.keep = c_.ckpt_keep;
    o.async = c_.ckpt_async;
    checkpointer_ = std::make_unique<dtrain::Checkpointer>(c_.ckpt_dir, o);
  }
  // The previous background write, reported before the next starts: a wait here blocks the
  // step as much as the copy does, so the line below counts it.
  const auto wait_start = std::chrono::steady_clock::now();
  wait_for_checkpoint();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
  dtrain::TrainingState state;
  state.step = step;
  state.values["seed"] = std::to_string(c_.seed);
  state.values["global_batch"] = std::to_string(c_.batch * info_.world_size * c_.grad_accum);
  if (scaler_) state.values.merge(scaler_->state_dict());
  const dtrain::CheckpointStats stats = checkpointer_->save(*strategy_, optimizer_.get(), state);
  if (c_.ckpt_async) {
    say(
        fmt::format("checkpoint: step {} copied in {:.3f} s on rank 0 after {:.3f} s waiting for "
                    "the previous write, writing to {} in the background",
                    step, stats.seconds, waited, stats.path));
  } else {
    say(fmt::format("checkpoint: step {} to {} ({:.1f} MiB written in {:.2f} s on rank 0)", step,
                    stats.path, static_cast<double>(stats.bytes) / kMiB, stats.seconds));
  }
  return stats.path;
}

void Trainer::wait_for_checkpoint() {
  if (!checkpointer_ || !checkpointer_->in_flight()) return;
  const dtrain::CheckpointStats stats = checkpointer_->wait();
  say(fmt::format("checkpoint: {} written in the background ({:.1f} MiB in {:.2f} s on rank 0)",
                  stats.path, static_cast<double>(stats.bytes) / kMiB, stats.seconds));
}

// --export: the fp32 weights streamed to rank 0 one tensor at a time and written there (a
// collective; GPT-2 only: flags.cpp refuses --export for BERT).
void Trainer::export_weights() {
  const int64_t tensors = export_hf_safetensors(c_.export_path, *strategy_);
  say(fmt::format("export: {} tensors in Hugging Face GPT-2 layout to {}", tensors,
                  c_.export_path));
}

}  // namespace gpt2

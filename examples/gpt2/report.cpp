#include "report.h"

#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace gpt2 {

void Reporter::say(const std::string& text) {
  if (!rank0_) return;
  if (progress_) {
    progress_->line(text);
  } else {
    fmt::print("{}\n", text);
    std::fflush(stdout);
  }
}

void Reporter::start(RunLabels labels, int64_t total_steps, int64_t epochs, int64_t log_every,
                     const std::string& metrics_out, bool append_metrics) {
  if (!rank0_) return;
  labels_ = std::move(labels);
  progress_ = std::make_unique<Progress>(total_steps, epochs, log_every, stdout_is_terminal());
  if (!metrics_out.empty()) metrics_ = std::make_unique<MetricsWriter>(metrics_out, append_metrics);
}

void Reporter::show_step(const StepRecord& r) {
  if (!progress_) return;
  progress_->step({r.step, r.epoch, r.loss, r.grad_norm, r.lr, r.tokens_per_s(), r.step_time_s});
}

JsonLine Reporter::base_line(const char* kind, int64_t step, int64_t epoch) const {
  JsonLine j;
  j.add("kind", kind).add("step", step).add("epoch", epoch).add("rank", labels_.rank);
  j.add("world_size", labels_.world_size).add("strategy", labels_.strategy);
  j.add("transport", labels_.transport);
  j.add("blas", labels_.blas).add("blas_kernel", labels_.blas_kernel);
  j.add("cpu_bf16_native", labels_.cpu_bf16_native).add("generation", labels_.generation);
  return j;
}

namespace {

// Bytes on the wire of the step, summed over ranks (docs/gpt2.md): null where the backend
// does not count them (NCCL).
void add_wire_fields(JsonLine& j, const dtrain::WireStats& w) {
  auto field = [&](const std::string& name, uint64_t bytes) {
    j.add(name, w.counted ? std::optional<double>(static_cast<double>(bytes)) : std::nullopt);
  };
  const dtrain::WireBytes total = w.total();
  field("wire_bytes_intra_host", total.intra_host);
  field("wire_bytes_inter_host", total.inter_host);
  const std::pair<const char*, const dtrain::WireBytes*> kinds[] = {
      {"all_reduce", &w.all_reduce},         {"broadcast", &w.broadcast},
      {"all_gather", &w.all_gather},         {"reduce_scatter", &w.reduce_scatter},
      {"point_to_point", &w.point_to_point}, {"control", &w.control}};
  for (const auto& [kind, bytes] : kinds) {
    field(fmt::format("wire_bytes_{}_intra_host", kind), bytes->intra_host);
    field(fmt::format("wire_bytes_{}_inter_host", kind), bytes->inter_host);
  }
}

}  // namespace

void Reporter::write_step(const StepRecord& r) {
  if (!metrics_) return;
  JsonLine j = base_line("step", r.step, r.epoch);
  j.add("loss", r.loss).add("val_loss", r.val_loss).add("grad_norm", r.grad_norm);
  j.add("tokens_per_s", r.tokens_per_s()).add("step_time_s", r.step_time_s);
  j.add("epoch_time_s", std::optional<double>());
  j.add("samples", r.samples).add("samples_hash", r.samples_hash);
  j.add("peak_rss_mib", r.peak_rss_mib());
  j.add("peak_rss_mib_per_rank", r.peak_rss_mib_per_rank);
  j.add("model_state_mib", r.model_state_mib());
  j.add("model_state_mib_per_rank", r.model_state_mib_per_rank);
  if (r.cuda_peak_mib()) {
    j.add("cuda_peak_mib", r.cuda_peak_mib())
        .add("cuda_peak_mib_per_rank", r.cuda_peak_mib_per_rank);
  }
  j.add("comm_wait_s", r.comm_wait_s).add("comm_total_s", r.comm_total_s);
  j.add("num_collectives", r.num_collectives).add("lr", r.lr);
  add_wire_fields(j, r.wire);
  if (r.loss_scale) j.add("loss_scale", *r.loss_scale).add("skipped", r.skipped ? 1 : 0);
  metrics_->write(j);
}

void Reporter::write_eval(int64_t step, double val_loss, double validation_time_s) {
  say(fmt::format("eval: val_loss {:.4f} of the weights at step {} ({:.1f} s)", val_loss, step,
                  validation_time_s));
  if (!metrics_) return;
  JsonLine j = base_line("eval", step, 0);
  j.add("val_loss", val_loss).add("validation_time_s", validation_time_s);
  metrics_->write(j);
}

void Reporter::write_epoch(const EpochRecord& e) {
  say(
      fmt::format("epoch {}/{}: loss {:.4f} val_loss {:.4f} grad_norm {:.3f} {:.0f} tok/s "
                  "{:.1f} s peak RSS {:.0f} MiB (max over ranks), model state {:.1f} MiB/rank",
                  e.epoch, e.epochs, e.loss, e.val_loss, e.grad_norm, e.tokens_per_s,
                  e.epoch_time_s, e.peak_rss_mib(), e.model_state_mib()));
  if (!metrics_) return;
  JsonLine j = base_line("epoch", e.step, e.epoch);
  j.add("loss", e.loss).add("val_loss", e.val_loss).add("grad_norm", e.grad_norm);
  j.add("tokens_per_s", e.tokens_per_s).add("step_time_s", e.step_time_s);
  j.add("epoch_time_s", e.epoch_time_s);
  j.add("peak_rss_mib", e.peak_rss_mib());
  j.add("peak_rss_mib_per_rank", e.peak_rss_mib_per_rank);
  j.add("model_state_mib", e.model_state_mib());
  j.add("model_state_mib_per_rank", e.model_state_mib_per_rank);
  if (e.cuda_peak_mib()) {
    j.add("cuda_peak_mib", e.cuda_peak_mib())
        .add("cuda_peak_mib_per_rank", e.cuda_peak_mib_per_rank);
  }
  j.add("comm_wait_s", e.comm_wait_s).add("validation_time_s", e.validation_time_s);
  metrics_->write(j);
}

}  // namespace gpt2

// What gpt2_train measures: one record per optimizer step and one per epoch, each written
// once as a metrics line (report.h). Field names are those of the metrics lines
// (docs/gpt2.md).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dtrain/wire_stats.h"

namespace gpt2 {

struct StepRecord {
  int64_t step = 0;   // optimizer steps taken, this one included (1-based)
  int64_t epoch = 0;  // 1-based
  double lr = 0;
  double loss = 0;       // mean over ranks of each rank's mean loss over its micro-batches
  double grad_norm = 0;  // global gradient norm before clipping
  int64_t tokens = 0;    // tokens of the global batch
  // The sequences trained in the step and an order-free digest of their indices
  // (sample_digest): this rank's, then (after the step's all-gather) summed over all ranks.
  // Equal digests step by step mean the same samples, whatever the world size.
  int64_t samples = 0;
  int64_t samples_hash = 0;
  double step_time_s = 0;
  // The strategy's StepStats, summed over the step's micro-batches.
  double comm_wait_s = 0, comm_total_s = 0;
  int64_t num_collectives = 0;
  // Bytes on the wire of the step (wire_stats.h): this rank's (its micro-batches'
  // StepStats::wire, the gradient norm's included, plus the loss scale's agreement), then
  // (after the step's all-gather, gather_rank_values) summed over all ranks: the bytes the
  // whole job sent.
  dtrain::WireStats wire;
  // One entry per rank, exchanged in the step's all-gather.
  std::vector<double> peak_rss_mib_per_rank, model_state_mib_per_rank;
  // The CUDA caching allocator's peak per rank on --device cuda (cuda_memory.h); empty else.
  std::vector<double> cuda_peak_mib_per_rank;
  int stop_signal = 0;             // a SIGTERM/SIGINT some rank received (0: none)
  std::optional<double> val_loss;  // a mid-epoch validation after this step (--val_every)
  // With a loss scale (--loss_scale): the scale this step's loss was multiplied by, and
  // whether the step was skipped (inf/NaN in some rank's gradients).
  std::optional<double> loss_scale;
  bool skipped = false;

  double tokens_per_s() const { return static_cast<double>(tokens) / step_time_s; }
  double peak_rss_mib() const;                  // max over ranks
  double model_state_mib() const;               // max over ranks
  std::optional<double> cuda_peak_mib() const;  // max over ranks; nullopt off CUDA
};

// WireStats as numbers for the step's all-gather (kWireValues of them: counted, then intra-
// and inter-host bytes per kind), and back, added to `w`.
constexpr size_t kWireValues = 13;
std::vector<double> wire_values(const dtrain::WireStats& w);
void add_wire_values(dtrain::WireStats& w, const double* values);

struct EpochRecord {
  int64_t epoch = 0, epochs = 0;  // 1-based, of
  int64_t step = 0;               // optimizer steps taken at its end (set by the caller)
  double loss = 0, val_loss = 0, grad_norm = 0, step_time_s = 0, comm_wait_s = 0;  // means
  double tokens_per_s = 0;       // over the epoch's training time
  double epoch_time_s = 0;       // training time, validations excluded
  double validation_time_s = 0;  // of the end-of-epoch validation
  std::vector<double> peak_rss_mib_per_rank, model_state_mib_per_rank;  // at its last step
  std::vector<double> cuda_peak_mib_per_rank;                           // at its last step

  double peak_rss_mib() const;
  double model_state_mib() const;
  std::optional<double> cuda_peak_mib() const;
};

// Sums of an epoch's step records.
class EpochTotals {
 public:
  void add(const StepRecord& r);
  void add_validation_time(double seconds) { val_time_s_ += seconds; }
  double validation_time_s() const { return val_time_s_; }
  // The epoch's means; tokens_per_s from `epoch_time_s`.
  EpochRecord record(int64_t epoch, int64_t epochs, double epoch_time_s) const;

 private:
  double loss_ = 0, grad_norm_ = 0, step_time_ = 0, comm_wait_ = 0, val_time_s_ = 0;
  int64_t steps_ = 0, tokens_ = 0;
  StepRecord last_;
};

// A sequence's (its index in the corpus) 32-bit hash; a step's digest is the sum over its
// sequences, independent of which rank read which and of their order. Sums stay exact in
// the all-gather's doubles up to 2^21 sequences per step.
int64_t sample_digest(int64_t sequence);

// Largest value (NaN for none).
double max_of(const std::vector<double>& values);

}  // namespace gpt2

// What gpt2_train shows and writes, on rank 0 only: log lines (a progress bar on a
// terminal), and the metrics file (--metrics_out, one JSON line per step and per epoch;
// fields in docs/gpt2.md). On other ranks every call does nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "metrics.h"
#include "progress.h"
#include "records.h"

namespace gpt2 {

// Written into every metrics line.
struct RunLabels {
  int rank = 0, world_size = 1;
  std::string strategy;  // Strategy::name()
  // Communicator::transport_name() of the world's communicator ("gloo", "shared_memory",
  // "hierarchical", "nccl", "mpi"); "none" for one rank without one.
  std::string transport = "none";
  std::string blas;         // library and version
  std::string blas_kernel;  // "unknown" when the library does not say
  // The CPU computes bf16 natively (avx512_bf16 or AMX-BF16; dtrain/blas.h). false: bf16 is
  // emulated and --precision bf16 runs many times slower than fp32 (docs/gpt2.md).
  bool cpu_bf16_native = false;
  // DTRAIN_GENERATION: the launcher's generation of this run's ranks (dtrain-run restarts and
  // elastic generations; 0 when started otherwise).
  int64_t generation = 0;
};

class Reporter {
 public:
  explicit Reporter(bool rank0) : rank0_(rank0) {}

  // A line that stays visible (log, or above the progress bar).
  void say(const std::string& text);

  // Starts the progress display and opens metrics_out (truncated; empty: no metrics file).
  // append_metrics: a resumed run adds to the metrics file instead of truncating it.
  void start(RunLabels labels, int64_t total_steps, int64_t epochs, int64_t log_every,
             const std::string& metrics_out, bool append_metrics = false);

  // The step on the progress display.
  void show_step(const StepRecord& r);
  // The step's metrics line.
  void write_step(const StepRecord& r);
  // The epoch's summary line and metrics line.
  void write_epoch(const EpochRecord& e);
  // --eval_only: the evaluation's line and metrics line ("kind": "eval").
  void write_eval(int64_t step, double val_loss, double validation_time_s);

 private:
  JsonLine base_line(const char* kind, int64_t step, int64_t epoch) const;

  bool rank0_;
  RunLabels labels_;
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<MetricsWriter> metrics_;
};

}  // namespace gpt2

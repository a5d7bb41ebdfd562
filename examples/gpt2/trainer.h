// The trainer of one rank: one loop for every strategy and every task (GPT-2 or BERT,
// task.h). run() reads top to bottom:
// set up (process, device and communicator, data, model and strategy, optimizer), then
// epochs of steps, each step one record that is shown and written once, then the end of the
// run (finish, export, sample).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "blas_setup.h"
#include "data.h"
#include "dtrain/autocast.h"
#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/grad_scaler.h"
#include "dtrain/preemption.h"
#include "dtrain/rendezvous.h"
#include "dtrain/store.h"
#include "dtrain/strategy.h"
#include "dtrain/wire_stats.h"
#include "kineto_trace.h"
#include "model.h"
#include "op_profile.h"
#include "records.h"
#include "report.h"
#include "task.h"
#include "tokenizer.h"
#include "train_config.h"

namespace gpt2 {

class Trainer {
 public:
  Trainer(Config config, dtrain::LaunchInfo info, BlasSetup blas);
  void run();

 private:
  // How many steps the run takes, from the data and the flags.
  struct Schedule {
    int64_t steps_per_epoch = 0, total_steps = 0, epochs = 0;
    int64_t tokens_per_step = 0;  // of the global batch
  };
  static constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  // Where the run stands, across epochs.
  struct RunState {
    int64_t start_step = 0;  // where this process started (a resumed run: > 0)
    int64_t step = 0;        // optimizer steps taken
    double last_loss = kNaN, last_val = kNaN, last_grad_norm = kNaN, max_rss = 0;
  };

  // Set-up, in order (trainer_setup.cpp).
  void setup_process();
  void setup_device_and_comm();
  void setup_data();
  // The memory planner (trainer_memory.cpp): resolves --strategy auto, refuses a run whose
  // estimate exceeds the memory per rank.
  void plan_memory();
  void setup_model_and_strategy();
  void setup_optimizer();  // and the loss scaler
  Schedule plan_schedule();
  // `mine` from every rank in rank order, rounded; a collective with several ranks.
  std::vector<int64_t> every_rank(double mine);

  // Training (trainer.cpp).
  void train_epoch(const Schedule& schedule, int64_t epoch, RunState& run);
  void evaluate_only(int64_t step);
  StepRecord train_step(const Schedule& schedule, int64_t epoch, int64_t index_in_epoch,
                        int64_t step);
  at::Tensor micro_step(int64_t micro_batch, bool last, StepRecord& record);
  at::Tensor model_loss(const at::Tensor& x, const at::Tensor& y);
  void gather_rank_values(double local_loss, StepRecord& record);
  double validate();
  void write_profile(int64_t total_steps);
  void write_trace(int64_t total_steps);

  // Checkpoints and weights (trainer_checkpoint.cpp).
  int64_t resume_step();
  void checkpoint_or_stop(const StepRecord& r, int64_t total_steps);
  std::string save_checkpoint(int64_t step);
  void wait_for_checkpoint();  // --ckpt_async: the write in flight complete (or its error)
  void export_weights();

  // The sample at the end (sample.cpp).
  void generate_sample();

  bool rank0() const { return info_.rank == 0; }
  void say(const std::string& text) { report_.say(text); }
  void sync_device();

  Config c_;
  dtrain::LaunchInfo info_;
  BlasSetup blas_;
  int threads_ = 1;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::shared_ptr<dtrain::Store> store_;
  dtrain::CommunicatorPtr comm_;
  dtrain::CommunicatorOptions comm_options_;  // the world's; the hybrid groups' too
  std::unique_ptr<Tokenizer> tokenizer_;
  int64_t token_ids_ = 0;  // the tokenizer's ids (GPT-2's 50257 without a vocabulary)
  TokenView train_tokens_, val_tokens_;
  std::unique_ptr<DistributedSampler> train_sampler_, val_sampler_;
  std::unique_ptr<Task> task_;  // the model, its batches and its loss
  std::shared_ptr<dtrain::Strategy> strategy_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  // With --ckpt_dir: SIGTERM/SIGINT become a checkpoint and a stop at the next step boundary;
  // its received() travels in each step's all-gather (gather_rank_values), so every rank stops
  // at the same step with no collective of its own.
  std::optional<dtrain::StopSignal> stop_;
  int stop_signal() const { return stop_ ? stop_->received() : 0; }
  std::optional<dtrain::Autocast> autocast_;    // --precision bf16/fp16 under single and ddp
  std::unique_ptr<dtrain::GradScaler> scaler_;  // --loss_scale
  Reporter report_;
  std::unique_ptr<OpProfile> op_profile_;  // rank 0 with --profile_out
  std::unique_ptr<KinetoTrace> trace_;     // rank 0 with --trace_out
  // With --ckpt_dir. Last: destroyed first, it waits for a background write in flight.
  std::unique_ptr<dtrain::Checkpointer> checkpointer_;
};

}  // namespace gpt2

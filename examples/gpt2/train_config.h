// What gpt2_train is asked to do: every flag parsed once into typed values (flags.cpp), so
// that the trainer never compares strings. Choices are enums; each has to_string() giving
// the flag's spelling back, for log lines and metrics.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "bert_model.h"
#include "dtrain/blas.h"
#include "dtrain/checkpoint.h"
#include "dtrain/fsdp.h"
#include "model.h"

namespace gpt2 {

enum class StrategyKind { kSingle, kDdp, kFsdp };
// --model: a GPT-2 preset (causal language model) or a BERT preset (masked language model).
enum class ModelKind { kGpt2, kBert };
enum class DeviceKind { kCpu, kCuda };
// --backend: auto is NCCL on CUDA and Gloo on the CPU; gloo (and mpi) on CUDA stage tensors
// through host memory, so several ranks can share one GPU; mpi needs an MPI launcher.
enum class BackendKind { kAuto, kNccl, kGloo, kMpi };
enum class Precision { kFp32, kBf16, kFp16 };
// fused: the LM head's cross-entropy chunk by chunk (lm_head_loss.h); standard: logits first.
enum class LossKind { kFused, kStandard };
// How gradients are reduced: ddp's comm hook, or fsdp's reduce dtype (kAllreduce: fp32).
enum class CommHookKind { kAllreduce, kFp16, kBf16, kParameterServer, kPowerSgd };
// kText: a file or folder (empty path: the built-in corpus); kRandom: uniform random tokens.
enum class DataKind { kText, kRandom };
enum class TokenizerKind { kGpt2, kByte };
// --loss_scale: none, dynamic (dtrain::GradScaler's backoff and growth) or a fixed scale.
enum class LossScaleKind { kNone, kDynamic, kFixed };

const char* to_string(StrategyKind v);
const char* to_string(ModelKind v);
const char* to_string(DeviceKind v);
const char* to_string(Precision v);
const char* to_string(CommHookKind v);
const char* to_string(TokenizerKind v);
// The --sharding and --prefetch spellings (full, grad_op, ...; pre, post, none).
const char* sharding_flag_name(dtrain::ShardingStrategy v);
const char* prefetch_flag_name(dtrain::BackwardPrefetch v);

struct Config {
  // Launch
  StrategyKind strategy = StrategyKind::kSingle;
  // --strategy auto: the memory planner picks strategy, sharding and shard_group_size once
  // the world size is known (Trainer::plan_memory); until then `strategy` is provisional.
  bool strategy_auto = false;
  // --memory_per_rank in bytes; 0: the default (the device's memory on CUDA; on the CPU
  // MemAvailable or the cgroup limit, shared among the local ranks).
  int64_t memory_per_rank = 0;
  int nproc = 1;
  DeviceKind device = DeviceKind::kCpu;
  BackendKind backend = BackendKind::kAuto;
  int threads = 0;  // 0: cores / LOCAL_WORLD_SIZE
  dtrain::BlasKernelPolicy blas_kernel = dtrain::BlasKernelPolicy::kAuto;
  int timeout_s = 300;

  // Model: the preset's kind picks which of gpt and bert is used (task.h builds it); their
  // vocab_size is set from the tokenizer when the model is built.
  std::string model;  // the preset's name
  ModelKind model_kind = ModelKind::kGpt2;
  GptConfig gpt;
  bert::BertConfig bert;
  int64_t vocab = 0;  // --vocab (0: the tokenizer's; BERT: plus [MASK])

  // Data
  DataKind data = DataKind::kText;
  std::string data_path;  // kText: empty means the built-in corpus
  TokenizerKind tokenizer = TokenizerKind::kGpt2;
  std::string vocab_dir;
  int64_t max_tokens = 0;
  double val_fraction = 0;

  // Schedule
  int64_t batch = 0, grad_accum = 1, epochs = 1, steps = 0, steps_per_epoch = 0;
  // --global_batch: sequences per optimizer step over all ranks (0: batch x ranks x
  // grad_accum); the trainer derives grad_accum from it once it knows the world size.
  int64_t global_batch = 0;
  int64_t seed = 0;

  // Optimizer
  double lr = 0, min_lr_ratio = 0, weight_decay = 0, clip = 0;
  bool fused_adamw = true;  // dtrain::FusedAdamW, else torch::optim::AdamW
  int64_t warmup_steps = 0;

  // Precision and communication
  Precision precision = Precision::kFp32;
  LossScaleKind loss_scale = LossScaleKind::kNone;  // "auto" resolved: dynamic for fp16
  double loss_scale_value = 65536;                  // kFixed: the scale; kDynamic: the first
  int64_t loss_scale_interval = 2000;               // kDynamic: clean steps before growing
  LossKind loss = LossKind::kFused;
  CommHookKind comm_hook = CommHookKind::kAllreduce;
  dtrain::Quantization quantize_grads = dtrain::Quantization::kNone;   // ddp, fsdp
  dtrain::Quantization quantize_params = dtrain::Quantization::kNone;  // fsdp
  int powersgd_rank = 1;                                               // --comm_hook powersgd
  int64_t powersgd_start_iter = 10;                                    // --comm_hook powersgd
  double bucket_mb = 0;
  dtrain::ShardingStrategy sharding = dtrain::ShardingStrategy::kFullShard;
  int shard_group_size = 0;
  // fsdp: FsdpOptions::reshard_after_forward; unset: the sharding strategy's.
  std::optional<dtrain::ReshardAfterForward> reshard_after_forward;
  dtrain::BackwardPrefetch prefetch = dtrain::BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  bool cpu_offload = false;  // fsdp: shards and optimizer state in host memory
  bool malloc_tuning = true;

  // Evaluation and output
  int64_t val_every = 0, val_batches = 0, log_every = 10;
  std::string metrics_out, profile_out;
  std::string trace_out;  // --trace_out: a Kineto trace of the profiled steps
  int64_t profile_steps = 0;
  int64_t sample_tokens = 0;
  std::string prompt;
  int top_k = 0;
  double temperature = 1;

  // Checkpoints
  std::string ckpt_dir;
  dtrain::CheckpointFormat ckpt_format = dtrain::CheckpointFormat::kSharded;
  int64_t ckpt_every = 0;
  int ckpt_keep = 2;
  bool ckpt_async = false;  // --ckpt_async: background writes
  bool resume = false;
  bool eval_only = false;  // validation loss and sample of the loaded weights, no step
  std::string export_path, init_from;

  bool fused_loss() const { return loss == LossKind::kFused; }
  // The chosen model's context: the training sequence length.
  int64_t context() const { return model_kind == ModelKind::kBert ? bert.context : gpt.context; }
  // bf16/fp16 under single and ddp: ATen autocast around the forward (fsdp: param_dtype).
  bool autocast() const { return precision != Precision::kFp32 && strategy != StrategyKind::kFsdp; }
};

// Throws dtrain::InvalidArgument(message) when !ok.
void check(bool ok, const std::string& message);

// Linear warmup to c.lr over c.warmup_steps, then a cosine down to lr * min_lr_ratio at the
// last step (step counts from 0).
double learning_rate(const Config& c, int64_t step, int64_t total_steps);

}  // namespace gpt2

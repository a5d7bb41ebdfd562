// gpt2_train: trains GPT-2 with one loop for every strategy (single device, DDP, FSDP) and
// writes the metrics the single/DDP/FSDP comparison reports. See docs/gpt2.md.
//
//   gpt2_train --strategy single --batch 8
//   gpt2_train --strategy ddp --nproc 2 --batch 4          # starts its two ranks itself
//   dtrain-run --nproc_per_node 2 -- gpt2_train --strategy fsdp --batch 4
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <sched.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>

#include <csignal>

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/flags/usage.h>
#include <absl/flags/usage_config.h>
#include <fmt/format.h>

#include "data.h"
#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/dtrain.h"
#include "dtrain/fsdp.h"
#include "dtrain/host_memory.h"
#include "dtrain/single_device.h"
#include "hf_weights.h"
#include "launcher/local_ranks.h"
#include "metrics.h"
#include "model.h"
#include "op_profile.h"
#include "progress.h"
#include "tokenizer.h"

// ---- Flags ------------------------------------------------------------------------------

// Launch
ABSL_FLAG(std::string, strategy, "single",
          "single | ddp | fsdp: how the model is spread over ranks. single: one process, no "
          "communication (the baseline). ddp: every rank holds the model, gradients are "
          "all-reduced in buckets during backward. fsdp: parameters, gradients and optimizer "
          "state sharded over ranks, every transformer block an FSDP unit.");
ABSL_FLAG(int, nproc, 1,
          "Ranks to start on this machine. With N > 1 the program starts N copies of itself "
          "as ranks 0..N-1 (posix_spawn of /proc/self/exe with RANK, WORLD_SIZE, LOCAL_RANK, "
          "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) and waits for them. Ignored when "
          "RANK is already set (started by dtrain-run, torchrun or a cluster launcher: the "
          "process is then that rank).");
ABSL_FLAG(std::string, device, "cpu",
          "cpu | cuda. cuda: rank r uses GPU LOCAL_RANK and the NCCL backend (when built).");
ABSL_FLAG(int, threads, 0,
          "Intra-op threads per rank; 0: max(1, cores / LOCAL_WORLD_SIZE) so that the ranks "
          "of one machine share its cores.");
ABSL_FLAG(std::string, blas_kernel, "auto",
          "auto | keep. auto: when OpenBLAS runs its generic kernels (e.g. Prescott) or an older "
          "family than this CPU supports, run with OPENBLAS_CORETYPE set to the CPU's best "
          "family (SkylakeX for AVX-512, Haswell for AVX2, ...). OpenBLAS reads it only when it "
          "loads: --nproc ranks start with it, a single process restarts itself once with it "
          "(same pid and arguments). An OPENBLAS_CORETYPE already set is always kept. The run "
          "header and the metrics (blas, blas_kernel) say what ran. keep: leave the BLAS as it "
          "loads. See docs/blas.md.");
ABSL_FLAG(int, timeout_s, 300,
          "Bound on connecting and on each collective, in seconds: a dead or hung rank makes "
          "the others fail after this long.");

// Model
ABSL_FLAG(std::string, model, "tiny",
          "Preset: tiny (4 layers, 4 heads, dim 256, ctx 128; 16.1M parameters), paper-27m (6, "
          "6, 360, 256; 27.5M), gpt2 (12, 12, 768, 1024; 124M). The flags below override "
          "single dimensions.");
ABSL_FLAG(int64_t, layers, 0, "Transformer blocks (0: the preset's).");
ABSL_FLAG(int64_t, heads, 0, "Attention heads; must divide --dim (0: the preset's).");
ABSL_FLAG(int64_t, dim, 0, "Embedding width (0: the preset's).");
ABSL_FLAG(int64_t, ctx, 0, "Context length; also the training sequence length (0: the preset's).");
ABSL_FLAG(int64_t, vocab, 0,
          "Embedding rows (0: the tokenizer's vocabulary). May exceed it, e.g. 50304 for "
          "friendlier matrix shapes; extra rows are never sampled.");

// Data
ABSL_FLAG(std::string, data, "",
          "Training text: a file (documents separated by <|endoftext|>), a folder of *.txt "
          "documents, or 'random' (uniform random tokens, for throughput runs). Default: "
          "$DTRAIN_DATA_DIR/sotu.txt, else <repo>/data/sotu.txt (scripts/fetch-data.sh). "
          "Tokenized once into a cache file next to it.");
ABSL_FLAG(std::string, tokenizer, "gpt2",
          "gpt2 (byte-level BPE, 50257 ids; needs --vocab_dir) | byte (256 ids, no files).");
ABSL_FLAG(std::string, vocab_dir, "",
          "Folder with GPT-2's encoder.json and vocab.bpe (default: <data dir>/gpt2).");
ABSL_FLAG(int64_t, max_tokens, 0,
          "Use only the first N tokens of the corpus (before the train/validation split), "
          "e.g. to make epochs short; with --data random, the number of tokens drawn "
          "(0: the whole corpus; 1M random tokens).");
ABSL_FLAG(double, val_fraction, 0.05, "Share of the tokens held out for validation (the end).");

// Schedule
ABSL_FLAG(int64_t, batch, 8,
          "Sequences per rank per micro-batch. The global batch of a step is batch x ranks x "
          "grad_accum sequences of ctx tokens; compare strategies at the same global batch.");
ABSL_FLAG(int64_t, grad_accum, 1,
          "Micro-batches per optimizer step. DDP communicates only on the last one (no_sync).");
ABSL_FLAG(int64_t, epochs, 1, "Passes over the training tokens (ignored when --steps is set).");
ABSL_FLAG(int64_t, steps, 0,
          "Optimizer steps in total; 0: --epochs x steps per epoch. Epochs still mark the "
          "per-epoch metrics.");
ABSL_FLAG(int64_t, steps_per_epoch, 0,
          "Cap on optimizer steps per epoch (0: a full pass over the training tokens).");
ABSL_FLAG(int64_t, seed, 1234,
          "Seed of the model's initialization, the data order, random data and sampling.");

// Optimizer
ABSL_FLAG(double, lr, 6e-4, "Peak learning rate of AdamW (betas 0.9, 0.95, eps 1e-8).");
ABSL_FLAG(int64_t, warmup_steps, 10, "Steps of linear warmup from 0 to --lr.");
ABSL_FLAG(double, min_lr_ratio, 0.1,
          "After warmup the learning rate follows a cosine from --lr down to lr x this at the "
          "last step.");
ABSL_FLAG(double, weight_decay, 0.1,
          "AdamW's decoupled weight decay, applied to every parameter (FSDP steps flat "
          "shards, so no parameter can be exempted; the same for every strategy).");
ABSL_FLAG(double, clip, 1.0,
          "Clip the global gradient norm to this value (0: no clipping; the norm is still "
          "measured and reported).");

// Precision and communication
ABSL_FLAG(std::string, precision, "fp32",
          "fp32 | bf16 | fp16. bf16/fp16 are FSDP mixed precision (param_dtype: blocks "
          "compute in bf16/fp16 from fp32 shards; fp32 optimizer). single and ddp support "
          "fp32 only (use --comm_hook bf16 for cheaper DDP communication). fp16 needs "
          "--device cuda and has no loss scaling.");
ABSL_FLAG(std::string, loss, "fused",
          "How the LM head's cross-entropy is computed. fused: chunk by chunk of rows with the "
          "gradients formed in place, never materializing the [batch, context, vocab] logits "
          "(examples/gpt2/lm_head_loss.h) | standard: logits, then cross_entropy (autograd "
          "through both). Same loss and gradients up to fp32 rounding.");
ABSL_FLAG(std::string, comm_hook, "allreduce",
          "How gradients are reduced. ddp: allreduce (average in fp32) | fp16 | bf16 (compress "
          "to 16 bits on the wire) | ps (parameter server: rank 0 gathers, averages and "
          "broadcasts). fsdp: allreduce | fp16 | bf16 (FSDP's reduce_dtype).");
ABSL_FLAG(double, bucket_mb, 25.0, "ddp: gradient bucket size in MiB.");
ABSL_FLAG(std::string, sharding, "full",
          "fsdp: full (ZeRO-3: parameters freed after forward and backward) | grad_op (ZeRO-2: "
          "kept from forward to backward) | no_shard (DDP-like) | hybrid (full within groups "
          "of --shard_group_size ranks, replicated across groups).");
ABSL_FLAG(int, shard_group_size, 0, "fsdp hybrid: ranks per shard group (0: LOCAL_WORLD_SIZE).");
ABSL_FLAG(std::string, prefetch, "pre",
          "fsdp backward prefetch: pre (gather the next unit when a unit's backward starts) | "
          "post (after its gradient is reduced) | none.");
ABSL_FLAG(bool, malloc_tuning, true,
          "Serve host blocks of 64 KiB and more with mmap and trim the heap (dtrain::"
          "tune_host_memory), so memory a step frees goes back to the system: lower peak RSS, "
          "most for FSDP. false: glibc's defaults.");
ABSL_FLAG(bool, activation_checkpointing, false,
          "Recompute every transformer block's forward during backward instead of keeping its "
          "activations: less memory, about one more forward of time (any strategy).");
ABSL_FLAG(bool, forward_prefetch, false, "fsdp: gather unit k+1 while unit k's forward runs.");

// Evaluation and output
ABSL_FLAG(int64_t, val_every, 0,
          "Validate every N steps as well (0: at the end of each epoch only).");
ABSL_FLAG(int64_t, val_batches, 8,
          "Batches per validation, each the size of a step's global batch (batch x ranks x "
          "grad_accum sequences), in corpus order (0: the whole validation split).");
ABSL_FLAG(std::string, metrics_out, "",
          "Write metrics as JSON lines here (rank 0): one line per step (\"kind\": \"step\") "
          "and one per epoch (\"kind\": \"epoch\"); see docs/gpt2.md for the fields.");
ABSL_FLAG(std::string, profile_out, "",
          "Profile ATen operators and autograd nodes over --profile_steps steps that follow "
          "the first 5 (warm-up) and write, per operator name, calls and self and total CPU "
          "time as JSON here (rank 0 only; other ranks are not profiled). The step is the one "
          "step_time_s measures. Empty: off, and nothing is observed. Format and method: "
          "examples/gpt2/op_profile.h; comparison with PyTorch: benchmarks/peer-profile.sh.");
ABSL_FLAG(int64_t, profile_steps, 5,
          "With --profile_out: steps to profile, after the first 5 of the run.");
ABSL_FLAG(int64_t, log_every, 10,
          "Steps between log lines when stdout is not a terminal (a terminal gets a bar).");
ABSL_FLAG(int64_t, sample_tokens, 48, "Tokens to generate from rank 0 at the end (0: none).");
ABSL_FLAG(std::string, prompt, "My fellow citizens,", "Start of the generated sample.");
ABSL_FLAG(int, top_k, 40, "Sample among the k most likely tokens (0: greedy).");
ABSL_FLAG(double, temperature, 0.8, "Sampling temperature (ignored when greedy).");

// Checkpoints (docs/checkpoints.md)
ABSL_FLAG(std::string, ckpt_dir, "",
          "Write checkpoints (model, AdamW state, step) into DIR/step_N. With it, SIGTERM or "
          "SIGINT makes every rank finish the current step, write a checkpoint and exit "
          "non-zero (what a scheduler sends before preemption).");
ABSL_FLAG(int64_t, ckpt_every, 0,
          "With --ckpt_dir: a checkpoint every N optimizer steps (0: only at the end and on "
          "SIGTERM/SIGINT); always one after the last step.");
ABSL_FLAG(int, ckpt_keep, 2, "With --ckpt_dir: complete checkpoints kept (the newest).");
ABSL_FLAG(bool, resume, false,
          "Continue from the latest complete checkpoint in --ckpt_dir (start fresh when there "
          "is none); pass the same flags as the interrupted run. Another strategy or world "
          "size with the same global batch also resumes.");
ABSL_FLAG(std::string, ckpt_format, "sharded",
          "full (rank 0 gathers and writes one file) | sharded (every rank writes its own "
          "shards; no rank holds the whole model).");
ABSL_FLAG(std::string, export, "",
          "After training, write the weights to PATH.safetensors with Hugging Face's GPT-2 "
          "names and layouts (transformers' GPT2LMHeadModel loads it).");
ABSL_FLAG(std::string, init_from, "",
          "Start from the weights of a Hugging Face GPT-2 safetensors file (e.g. gpt2's "
          "model.safetensors, or one written by --export); the model flags must match its "
          "shapes. Ignored when --resume finds a checkpoint.");

namespace gpt2 {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// --profile_out: steps run before profiling starts (allocator, caches and OpenMP pool warm).
constexpr int64_t kProfileWarmupSteps = 5;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void check(bool ok, const std::string& message) {
  if (!ok) throw dtrain::InvalidArgument(message);
}

bool one_of(const std::string& v, std::initializer_list<const char*> choices) {
  return std::any_of(choices.begin(), choices.end(), [&](const char* c) { return v == c; });
}

fs::path data_dir() {
  const char* env = std::getenv("DTRAIN_DATA_DIR");
  return env != nullptr && *env != '\0' ? fs::path(env) : fs::path(GPT2_DEFAULT_DATA_DIR);
}

// Everything the flags say, checked before any rank starts.
struct Config {
  std::string strategy, device, precision, loss, comm_hook, sharding, prefetch, data, tokenizer;
  std::string vocab_dir, metrics_out, profile_out, prompt, model;
  GptConfig gpt;
  int64_t vocab = 0, batch = 0, grad_accum = 1, epochs = 1, steps = 0, steps_per_epoch = 0;
  int64_t max_tokens = 0, warmup_steps = 0, val_every = 0, val_batches = 0, log_every = 10;
  int64_t sample_tokens = 0, seed = 0, profile_steps = 0;
  double val_fraction = 0, lr = 0, min_lr_ratio = 0, weight_decay = 0, clip = 0, bucket_mb = 0;
  double temperature = 1;
  int top_k = 0, threads = 0, timeout_s = 300, shard_group_size = 0;
  bool forward_prefetch = false;
  bool malloc_tuning = true;
  std::string ckpt_dir, ckpt_format, export_path, init_from;
  int64_t ckpt_every = 0;
  int ckpt_keep = 2;
  bool resume = false;
};

Config config_from_flags() {
  Config c;
  c.strategy = absl::GetFlag(FLAGS_strategy);
  c.device = absl::GetFlag(FLAGS_device);
  c.precision = absl::GetFlag(FLAGS_precision);
  c.loss = absl::GetFlag(FLAGS_loss);
  c.comm_hook = absl::GetFlag(FLAGS_comm_hook);
  c.sharding = absl::GetFlag(FLAGS_sharding);
  c.prefetch = absl::GetFlag(FLAGS_prefetch);
  c.forward_prefetch = absl::GetFlag(FLAGS_forward_prefetch);
  c.shard_group_size = absl::GetFlag(FLAGS_shard_group_size);
  c.data = absl::GetFlag(FLAGS_data);
  c.tokenizer = absl::GetFlag(FLAGS_tokenizer);
  c.vocab_dir = absl::GetFlag(FLAGS_vocab_dir);
  c.metrics_out = absl::GetFlag(FLAGS_metrics_out);
  c.profile_out = absl::GetFlag(FLAGS_profile_out);
  c.profile_steps = absl::GetFlag(FLAGS_profile_steps);
  c.prompt = absl::GetFlag(FLAGS_prompt);
  c.model = absl::GetFlag(FLAGS_model);
  c.vocab = absl::GetFlag(FLAGS_vocab);
  c.batch = absl::GetFlag(FLAGS_batch);
  c.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  c.epochs = absl::GetFlag(FLAGS_epochs);
  c.steps = absl::GetFlag(FLAGS_steps);
  c.steps_per_epoch = absl::GetFlag(FLAGS_steps_per_epoch);
  c.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  c.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  c.val_every = absl::GetFlag(FLAGS_val_every);
  c.val_batches = absl::GetFlag(FLAGS_val_batches);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  c.sample_tokens = absl::GetFlag(FLAGS_sample_tokens);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.min_lr_ratio = absl::GetFlag(FLAGS_min_lr_ratio);
  c.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  c.clip = absl::GetFlag(FLAGS_clip);
  c.bucket_mb = absl::GetFlag(FLAGS_bucket_mb);
  c.temperature = absl::GetFlag(FLAGS_temperature);
  c.top_k = absl::GetFlag(FLAGS_top_k);
  c.threads = absl::GetFlag(FLAGS_threads);
  c.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  c.ckpt_dir = absl::GetFlag(FLAGS_ckpt_dir);
  c.ckpt_format = absl::GetFlag(FLAGS_ckpt_format);
  c.ckpt_every = absl::GetFlag(FLAGS_ckpt_every);
  c.ckpt_keep = absl::GetFlag(FLAGS_ckpt_keep);
  c.resume = absl::GetFlag(FLAGS_resume);
  c.export_path = absl::GetFlag(FLAGS_export);
  c.malloc_tuning = absl::GetFlag(FLAGS_malloc_tuning);
  c.init_from = absl::GetFlag(FLAGS_init_from);

  c.gpt = preset(c.model);
  if (absl::GetFlag(FLAGS_layers) > 0) c.gpt.layers = absl::GetFlag(FLAGS_layers);
  c.gpt.activation_checkpointing = absl::GetFlag(FLAGS_activation_checkpointing);
  if (absl::GetFlag(FLAGS_heads) > 0) c.gpt.heads = absl::GetFlag(FLAGS_heads);
  if (absl::GetFlag(FLAGS_dim) > 0) c.gpt.dim = absl::GetFlag(FLAGS_dim);
  if (absl::GetFlag(FLAGS_ctx) > 0) c.gpt.context = absl::GetFlag(FLAGS_ctx);

  check(one_of(c.strategy, {"single", "ddp", "fsdp"}),
        "--strategy must be single, ddp or fsdp, got '" + c.strategy + "'");
  check(one_of(c.device, {"cpu", "cuda"}), "--device must be cpu or cuda");
  check(one_of(c.precision, {"fp32", "bf16", "fp16"}), "--precision must be fp32, bf16 or fp16");
  check(one_of(c.loss, {"fused", "standard"}), "--loss must be fused or standard");
  check(one_of(c.comm_hook, {"allreduce", "fp16", "bf16", "ps"}),
        "--comm_hook must be allreduce, fp16, bf16 or ps");
  check(one_of(c.sharding, {"full", "grad_op", "no_shard", "hybrid"}),
        "--sharding must be full, grad_op, no_shard or hybrid");
  check(one_of(c.prefetch, {"pre", "post", "none"}), "--prefetch must be pre, post or none");
  check(one_of(c.tokenizer, {"gpt2", "byte"}), "--tokenizer must be gpt2 or byte");
  if (c.precision != "fp32") {
    check(c.strategy == "fsdp",
          "--precision " + c.precision +
              " is supported with --strategy fsdp only (FSDP MixedPrecision: the blocks "
              "compute in " +
              c.precision +
              " from fp32 shards, the optimizer stays fp32). single and ddp train in fp32: "
              "LibTorch's stable C++ API has no autocast, and casting the model to " +
              c.precision + " is not mixed precision (the weights and Adam's state would be " +
              c.precision + " too). For cheaper DDP communication use --comm_hook bf16.");
    check(c.precision != "fp16" || c.device == "cuda",
          "--precision fp16 needs --device cuda (CPU kernels lack fp16; use bf16 on CPU)");
  }
  if (c.strategy == "fsdp") {
    check(c.comm_hook != "ps",
          "--comm_hook ps is a DataParallel hook; fsdp reduces with reduce-scatter (allreduce, "
          "fp16 or bf16 reduce dtype)");
  }
  c.gpt.vocab_size = 1;  // set from the tokenizer later; keeps validate() meaningful now
  c.gpt.validate();
  check(c.vocab >= 0, "--vocab must not be negative");
  check(c.batch >= 1, "--batch must be at least 1");
  check(c.grad_accum >= 1, "--grad_accum must be at least 1");
  check(c.epochs >= 1, "--epochs must be at least 1");
  check(c.steps >= 0 && c.steps_per_epoch >= 0 && c.max_tokens >= 0 && c.warmup_steps >= 0 &&
            c.val_every >= 0 && c.val_batches >= 0 && c.sample_tokens >= 0 && c.top_k >= 0,
        "step, token and batch counts must not be negative");
  check(c.profile_out.empty() || c.profile_steps >= 1,
        "--profile_steps must be at least 1 with --profile_out");
  check(c.val_fraction >= 0 && c.val_fraction < 1, "--val_fraction must be in [0, 1)");
  check(c.lr > 0, "--lr must be positive");
  check(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, "--min_lr_ratio must be in [0, 1]");
  check(c.weight_decay >= 0 && c.clip >= 0, "--weight_decay and --clip must not be negative");
  check(c.bucket_mb > 0, "--bucket_mb must be positive");
  check(c.temperature > 0, "--temperature must be positive");
  check(c.timeout_s > 0, "--timeout_s must be positive");
  check(c.threads >= 0 && c.shard_group_size >= 0, "--threads and --shard_group_size >= 0");
  check(one_of(c.ckpt_format, {"full", "sharded"}), "--ckpt_format must be full or sharded");
  check(c.ckpt_every >= 0 && c.ckpt_keep >= 1, "--ckpt_every >= 0 and --ckpt_keep >= 1");
  check(!c.resume || !c.ckpt_dir.empty(), "--resume needs --ckpt_dir");
  return c;
}

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Linear warmup to `lr`, then a cosine down to lr * min_lr_ratio at the last step.
double learning_rate(const Config& c, int64_t step, int64_t total_steps) {
  if (step < c.warmup_steps) {
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - c.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) / span);
  return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
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

// The SIGTERM/SIGINT received (0: none). A signal handler can only reach process-wide
// state; the training loop reads it once per step and all ranks agree on it (gather()).
volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) { g_stop_signal = sig; }

// With --ckpt_dir: SIGTERM/SIGINT set g_stop_signal instead of killing the process.
void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

// One row per rank of what rank 0 reports, exchanged with a single all-gather per step.
struct RankValues {
  std::vector<double> loss, peak_rss_mib, model_state_mib;
  int stop_signal = 0;  // a SIGTERM/SIGINT some rank received (0: none)

  static double max_of(const std::vector<double>& v) {
    return *std::max_element(v.begin(), v.end());
  }
  double mean_loss() const {
    double s = 0;
    for (double l : loss) s += l;
    return s / static_cast<double>(loss.size());
  }
};

// The BLAS this process runs and what --blas_kernel does about its kernel, decided in main
// before any rank starts.
struct BlasSetup {
  dtrain::BlasInfo info;
  dtrain::BlasKernelPlan plan;
};

BlasSetup blas_setup(const std::string& policy) {
  check(one_of(policy, {"auto", "keep"}), "--blas_kernel must be auto or keep");
  BlasSetup b;
  b.info = dtrain::BlasInfo::active();
  b.plan = dtrain::plan_blas_kernel(
      b.info, dtrain::CpuFeatures::detect(), dtrain::blas_environment_from_env(),
      policy == "auto" ? dtrain::BlasKernelPolicy::kAuto : dtrain::BlasKernelPolicy::kKeep);
  return b;
}

// OpenBLAS chose its kernels when this process loaded it, so the plan's choice takes effect
// only in a new process image: exec keeps the pid (a launcher supervising this rank sees no
// difference) and the arguments, and the DTRAIN_BLAS_CHOICE it adds prevents a second restart.
// Returns only when exec fails.
void restart_with(BlasSetup& blas, char** argv) {
  fmt::print("blas: {}; restarting with it (--blas_kernel keep: run as loaded)\n", blas.plan.note);
  std::fflush(stdout);
  std::vector<std::string> env = dtrain::launcher::environment_with(blas.plan.environment);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  execve("/proc/self/exe", argv, envp.data());
  blas.plan.note = blas.info.to_string() + fmt::format(" (restarting with {} failed: {})",
                                                       blas.plan.kernel, std::strerror(errno));
  fmt::print(stderr, "gpt2_train: blas: {}\n", blas.plan.note);
}

std::string blas_label(const dtrain::BlasInfo& b) {
  return b.version.empty() ? b.library : b.library + " " + b.version;
}

class Trainer {
 public:
  Trainer(Config config, dtrain::LaunchInfo info, BlasSetup blas)
      : c_(std::move(config)), info_(std::move(info)), blas_(std::move(blas)) {}
  void run();

 private:
  bool rank0() const { return info_.rank == 0; }
  void say(const std::string& text) {
    if (!rank0()) return;
    if (progress_) {
      progress_->line(text);
    } else {
      fmt::print("{}\n", text);
      std::fflush(stdout);
    }
  }
  void setup_device_and_comm();
  void setup_data();
  void setup_model_and_strategy();
  void write_profile(int64_t total_steps);
  RankValues gather(double loss, double model_state_mib);
  double validate();
  void generate_sample();
  int64_t resume_step(torch::optim::AdamW& opt);
  std::string save_checkpoint(torch::optim::AdamW& opt, int64_t step);
  void export_weights();
  void sync_device() {
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  }

  Config c_;
  dtrain::LaunchInfo info_;
  BlasSetup blas_;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::shared_ptr<dtrain::Store> store_;
  dtrain::CommunicatorPtr comm_;
  std::unique_ptr<Tokenizer> tokenizer_;
  TokenView train_tokens_, val_tokens_;
  std::unique_ptr<DistributedSampler> train_sampler_, val_sampler_;
  Gpt model_{nullptr};
  std::shared_ptr<dtrain::Strategy> strategy_;
  dtrain::DataParallel* ddp_ = nullptr;
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<OpProfile> op_profile_;  // rank 0 with --profile_out
};

void Trainer::setup_device_and_comm() {
  dtrain::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(c_.timeout_s);
  if (c_.device == "cuda") {
    check(torch::cuda::is_available(), "--device cuda: LibTorch sees no CUDA device");
    const auto n = static_cast<int>(torch::cuda::device_count());
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(info_.local_rank % n));
    options.backend = dtrain::Backend::kNccl;
    options.device_index = device_.index();
  }
  if (c_.strategy == "single") {
    check(info_.world_size == 1,
          fmt::format("--strategy single runs one rank, but WORLD_SIZE is {} (drop --nproc, or "
                      "use ddp/fsdp)",
                      info_.world_size));
    return;
  }
  if (info_.world_size > 1) {
    check(dtrain::is_backend_available(options.backend),
          std::string("this build has no ") + dtrain::to_string(options.backend) + " backend");
    store_ = dtrain::connect_store(info_, options.timeout);
    comm_ = dtrain::make_communicator(store_, info_.rank, info_.world_size,
                                      info_.communicator_options(options));
  } else {
    comm_ = dtrain::init_communicator(info_, options);
  }
}

void Trainer::setup_data() {
  const fs::path dir = data_dir();
  const fs::path vocab_dir = c_.vocab_dir.empty() ? dir / "gpt2" : fs::path(c_.vocab_dir);
  // Random tokens need no vocabulary: without GPT-2's files the model gets GPT-2's size and
  // the run ends without a sample.
  if (c_.data != "random" || c_.tokenizer != "gpt2" || has_gpt2_vocabulary(vocab_dir)) {
    tokenizer_ = make_tokenizer(c_.tokenizer, vocab_dir);
  }
  const int64_t ids = tokenizer_ ? tokenizer_->vocab_size() : kGpt2VocabSize;
  const int64_t vocab = c_.vocab > 0 ? c_.vocab : ids;
  check(vocab >= ids, fmt::format("--vocab {} is smaller than the {} tokenizer's {} ids", vocab,
                                  c_.tokenizer, ids));
  c_.gpt.vocab_size = vocab;

  TokenView tokens;
  if (c_.data == "random") {
    tokens = make_random_tokens(c_.max_tokens > 0 ? c_.max_tokens : int64_t{1} << 20, ids,
                                static_cast<uint64_t>(c_.seed));
    say(fmt::format("data: {} random tokens", tokens.size()));
  } else {
    const fs::path source = c_.data.empty() ? dir / "sotu.txt" : fs::path(c_.data);
    check(fs::exists(source), "no corpus at " + source.string() +
                                  " (run scripts/fetch-data.sh, set DTRAIN_DATA_DIR, or pass "
                                  "--data PATH or --data random)");
    // The first local rank tokenizes (once, into the cache); the others then read the cache.
    LoadedTokens loaded;
    if (info_.local_rank == 0) {
      const auto t0 = Clock::now();
      loaded = load_tokens(source, *tokenizer_);
      if (!loaded.from_cache) {
        say(fmt::format("data: tokenized {} in {:.1f} s", source.string(), seconds_since(t0)));
      }
    }
    if (comm_ && info_.world_size > 1) comm_->barrier_sync();
    if (info_.local_rank != 0) loaded = load_tokens(source, *tokenizer_);
    tokens = loaded.tokens;
    say(fmt::format("data: {} ({} {} tokens, cache {})", source.string(), tokens.size(),
                    tokenizer_->name(), loaded.cache_path.string()));
  }
  if (c_.max_tokens > 0 && tokens.size() > c_.max_tokens) {
    tokens = tokens.slice(0, c_.max_tokens);
  }
  const TrainValSplit split = split_train_val(tokens, c_.val_fraction);
  train_tokens_ = split.train;
  val_tokens_ = split.val;

  SamplerOptions so;
  so.seq_len = c_.gpt.context;
  so.batch_size = c_.batch;
  so.rank = info_.rank;
  so.world_size = info_.world_size;
  so.seed = static_cast<uint64_t>(c_.seed);
  const int64_t global_tokens = (so.seq_len * so.batch_size * so.world_size) + 1;
  check(train_tokens_.size() >= global_tokens,
        fmt::format("the training split has {} tokens, fewer than one global batch needs ({} x "
                    "{} ranks x {} tokens + 1); raise --max_tokens or lower --batch/--ctx",
                    train_tokens_.size(), so.batch_size, so.world_size, so.seq_len));
  train_sampler_ = std::make_unique<DistributedSampler>(train_tokens_.size(), so);
  // Validation batches are whole optimizer-step batches (batch x grad_accum per rank), so
  // runs with the same global batch validate on the same sequences whatever the split
  // into ranks and micro-batches.
  so.shuffle = false;
  so.batch_size = c_.batch * c_.grad_accum;
  if (val_tokens_.size() >= so.seq_len * so.batch_size * so.world_size + 1) {
    val_sampler_ = std::make_unique<DistributedSampler>(val_tokens_.size(), so);
  } else {
    say(
        fmt::format("data: validation disabled: the validation split ({} tokens) holds no "
                    "global batch",
                    val_tokens_.size()));
  }
}

void Trainer::setup_model_and_strategy() {
  at::manual_seed(static_cast<uint64_t>(c_.seed));  // identical initial weights on every rank
  model_ = Gpt(c_.gpt);
  model_->to(device_);
  say(fmt::format("model: {} ({}), {:.2f}M parameters{}", c_.model, c_.gpt.to_string(),
                  static_cast<double>(count_parameters(c_.gpt)) / 1e6,
                  c_.gpt.activation_checkpointing ? ", activation checkpointing" : ""));
  if (!c_.init_from.empty()) {
    init_from_hf_safetensors(c_.init_from, model_);
    say(fmt::format("model: initialized from {}", c_.init_from));
  }
  auto module = std::static_pointer_cast<torch::nn::Module>(model_.ptr());

  if (c_.strategy == "single") {
    dtrain::SingleDeviceOptions o;
    o.device = device_;
    strategy_ = std::make_shared<dtrain::SingleDevice>(module, o);
  } else if (c_.strategy == "ddp") {
    dtrain::DataParallelOptions o;
    o.bucket_cap_mb = c_.bucket_mb;
    if (c_.comm_hook == "fp16") o.comm_hook = dtrain::fp16_compress_hook();
    if (c_.comm_hook == "bf16") o.comm_hook = dtrain::bf16_compress_hook();
    if (c_.comm_hook == "ps") o.comm_hook = dtrain::parameter_server_hook(0);
    auto ddp = std::make_shared<dtrain::DataParallel>(module, comm_, o);
    ddp_ = ddp.get();
    strategy_ = ddp;
  } else {
    dtrain::FsdpOptions o;
    o.wrap_policy = dtrain::wrap_modules_named("BlockImpl");
    o.sharding = c_.sharding == "full"       ? dtrain::ShardingStrategy::kFullShard
                 : c_.sharding == "grad_op"  ? dtrain::ShardingStrategy::kShardGradOp
                 : c_.sharding == "no_shard" ? dtrain::ShardingStrategy::kNoShard
                                             : dtrain::ShardingStrategy::kHybridShard;
    o.backward_prefetch = c_.prefetch == "pre"    ? dtrain::BackwardPrefetch::kBackwardPre
                          : c_.prefetch == "post" ? dtrain::BackwardPrefetch::kBackwardPost
                                                  : dtrain::BackwardPrefetch::kNone;
    o.forward_prefetch = c_.forward_prefetch;
    if (c_.precision == "bf16") o.mixed_precision.param_dtype = at::kBFloat16;
    if (c_.precision == "fp16") o.mixed_precision.param_dtype = at::kHalf;
    if (c_.comm_hook == "bf16") o.mixed_precision.reduce_dtype = at::kBFloat16;
    if (c_.comm_hook == "fp16") o.mixed_precision.reduce_dtype = at::kHalf;
    if (o.sharding == dtrain::ShardingStrategy::kHybridShard) {
      const int group = c_.shard_group_size > 0 ? c_.shard_group_size : info_.local_world_size;
      check(store_ != nullptr && info_.world_size % group == 0,
            fmt::format("--sharding hybrid needs several ranks and a world size ({}) that is a "
                        "multiple of the shard group size ({})",
                        info_.world_size, group));
      dtrain::CommunicatorOptions go;
      go.timeout = std::chrono::seconds(c_.timeout_s);
      if (device_.is_cuda()) {
        go.backend = dtrain::Backend::kNccl;
        go.device_index = device_.index();
      }
      auto groups = dtrain::make_hybrid_groups(store_, info_.rank, info_.world_size, group,
                                               info_.communicator_options(go));
      o.shard_group = groups.shard_group;
      o.replicate_group = groups.replicate_group;
    }
    strategy_ = std::make_shared<dtrain::FullyShardedDataParallel>(module, comm_, o);
  }
  say(fmt::format("strategy: {} on {} rank(s), device {}, precision {}{}", strategy_->name(),
                  info_.world_size, device_.str(), c_.precision,
                  c_.strategy == "ddp"
                      ? fmt::format(", comm hook {}, buckets {} MiB", c_.comm_hook, c_.bucket_mb)
                  : c_.strategy == "fsdp" ? fmt::format(", sharding {}, prefetch {}, reduce {}",
                                                        c_.sharding, c_.prefetch, c_.comm_hook)
                                          : std::string()));
}

RankValues Trainer::gather(double loss, double model_state_mib) {
  const int world = info_.world_size;
  RankValues v;
  std::vector<double> mine = {loss, peak_rss_mib(), model_state_mib,
                              static_cast<double>(g_stop_signal)};
  v.stop_signal = static_cast<int>(g_stop_signal);
  if (!comm_ || world == 1) {
    v.loss = {mine[0]};
    v.peak_rss_mib = {mine[1]};
    v.model_state_mib = {mine[2]};
    return v;
  }
  const auto n = static_cast<int64_t>(mine.size());
  at::Tensor in = at::tensor(mine, at::TensorOptions().dtype(at::kDouble)).to(device_);
  at::Tensor out = at::empty({world * n}, in.options());
  comm_->all_gather_sync(out, in);
  out = out.cpu();
  const double* p = out.data_ptr<double>();
  for (int r = 0; r < world; ++r) {
    v.loss.push_back(p[r * n + 0]);
    v.peak_rss_mib.push_back(p[r * n + 1]);
    v.model_state_mib.push_back(p[r * n + 2]);
    v.stop_signal = std::max(v.stop_signal, static_cast<int>(p[r * n + 3]));
  }
  return v;
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
    Batch b = load_batch(val_tokens_, *val_sampler_, i);
    at::Tensor x = b.inputs.to(device_), y = b.targets.to(device_);
    at::Tensor loss = strategy_->forward([&] { return model_->loss(x, y, c_.loss == "fused"); });
    sum += loss.item<double>();
  }
  double mean = sum / static_cast<double>(std::max<int64_t>(n, 1));
  if (comm_ && info_.world_size > 1) {
    at::Tensor t = at::full({1}, mean, at::TensorOptions().dtype(at::kDouble)).to(device_);
    comm_->all_reduce_sync(t, dtrain::ReduceOp::kAvg);
    mean = t.item<double>();
  }
  return mean;
}

// A short sample from rank 0, decoded with the tokenizer. Under FSDP the full weights are
// gathered first (a collective) into an unwrapped copy of the model.
void Trainer::generate_sample() {
  if (c_.sample_tokens == 0) return;
  Gpt sampler = model_;
  if (auto* fsdp = dynamic_cast<dtrain::FullyShardedDataParallel*>(strategy_.get())) {
    auto full = fsdp->full_state_dict();
    if (!rank0()) return;
    sampler = Gpt(c_.gpt);
    sampler->to(device_);
    c10::NoGradGuard no_grad;
    auto params = sampler->named_parameters();
    for (const auto& [name, t] : full) {
      if (at::Tensor* p = params.find(name)) p->copy_(t);
    }
  }
  // Only rank 0 decodes, after every rank took part in the gather above: whether a
  // vocabulary exists (--data random needs none) may differ between nodes.
  if (!rank0() || !tokenizer_) return;
  c10::NoGradGuard no_grad;
  std::vector<int32_t> ids = tokenizer_->encode(c_.prompt);
  if (ids.empty()) ids.push_back(tokenizer_->eot() >= 0 ? tokenizer_->eot() : 0);
  const size_t prompt_len = ids.size();
  at::manual_seed(static_cast<uint64_t>(c_.seed));
  const int64_t real_vocab = tokenizer_->vocab_size();
  for (int64_t i = 0; i < c_.sample_tokens; ++i) {
    const size_t start = ids.size() > static_cast<size_t>(c_.gpt.context)
                             ? ids.size() - static_cast<size_t>(c_.gpt.context)
                             : 0;
    std::vector<int64_t> window(ids.begin() + static_cast<std::ptrdiff_t>(start), ids.end());
    at::Tensor x =
        at::tensor(window, at::TensorOptions().dtype(at::kLong)).view({1, -1}).to(device_);
    at::Tensor logits = sampler->forward(x).select(1, -1).to(at::kFloat).cpu();
    logits = logits.narrow(-1, 0, real_vocab);  // padded rows (--vocab) are never sampled
    int64_t next = 0;
    if (c_.top_k == 0) {
      next = logits.argmax(-1).item<int64_t>();
    } else {
      logits = logits / c_.temperature;
      auto top = logits.topk(std::min<int64_t>(c_.top_k, real_vocab), -1);
      at::Tensor probs = at::softmax(std::get<0>(top), -1);
      const int64_t choice = at::multinomial(probs, 1).item<int64_t>();
      next = std::get<1>(top).view({-1})[choice].item<int64_t>();
    }
    ids.push_back(static_cast<int32_t>(next));
  }
  const std::string prompt = tokenizer_->decode({ids.begin(), ids.begin() + prompt_len});
  const std::string text = tokenizer_->decode({ids.begin() + prompt_len, ids.end()});
  say(fmt::format("sample ({}): {}{}",
                  c_.top_k == 0 ? std::string("greedy")
                                : fmt::format("top-{}, temperature {}", c_.top_k, c_.temperature),
                  prompt, text));
}

void Trainer::run() {
  const int threads =
      c_.threads > 0 ? c_.threads : std::max(1, available_cores() / info_.local_world_size);
  at::set_num_threads(threads);
  say("blas: " + blas_.plan.note);
  if (c_.malloc_tuning) {
    const bool tuned = dtrain::tune_host_memory();
    say(tuned ? "host memory: blocks >= 64 KiB from mmap, heap trimmed above 128 KiB "
                "(--malloc_tuning=false: glibc's defaults)"
              : "host memory: glibc refused the tuning; running with its defaults");
  }
  setup_device_and_comm();
  setup_data();
  setup_model_and_strategy();

  torch::optim::AdamW opt(
      strategy_->parameters(),
      torch::optim::AdamWOptions(c_.lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(c_.weight_decay));

  const int64_t micro_per_epoch = train_sampler_->steps_per_epoch();
  int64_t steps_per_epoch = micro_per_epoch / c_.grad_accum;
  if (c_.steps_per_epoch > 0) steps_per_epoch = std::min(steps_per_epoch, c_.steps_per_epoch);
  check(steps_per_epoch > 0,
        fmt::format("an epoch holds {} global micro-batches, fewer than --grad_accum {}",
                    micro_per_epoch, c_.grad_accum));
  const int64_t total_steps = c_.steps > 0 ? c_.steps : c_.epochs * steps_per_epoch;
  const int64_t epochs = (total_steps + steps_per_epoch - 1) / steps_per_epoch;
  const int64_t tokens_per_step = c_.batch * info_.world_size * c_.grad_accum * c_.gpt.context;
  say(
      fmt::format("schedule: {} train / {} val tokens; {} steps in {} epoch(s) of up to {} steps; "
                  "global batch {} sequences x {} tokens; {} thread(s) per rank",
                  train_tokens_.size(), val_tokens_.size(), total_steps, epochs, steps_per_epoch,
                  c_.batch * info_.world_size * c_.grad_accum, c_.gpt.context, threads));

  if (rank0()) {
    progress_ = std::make_unique<Progress>(total_steps, epochs, c_.log_every, stdout_is_terminal());
    if (!c_.metrics_out.empty()) metrics_ = std::make_unique<MetricsWriter>(c_.metrics_out);
    if (!c_.profile_out.empty()) op_profile_ = std::make_unique<OpProfile>();
  }
  auto base_line = [&](const char* kind, int64_t step, int64_t epoch) {
    JsonLine j;
    j.add("kind", kind).add("step", step).add("epoch", epoch).add("rank", info_.rank);
    j.add("world_size", info_.world_size).add("strategy", strategy_->name());
    j.add("blas", blas_label(blas_.info));
    j.add("blas_kernel", blas_.info.kernel.empty() ? "unknown" : blas_.info.kernel);
    return j;
  };

  if (!c_.ckpt_dir.empty()) install_stop_handlers();
  const int64_t start_step = c_.resume ? resume_step(opt) : 0;
  const auto run_start = Clock::now();
  int64_t step = start_step;
  double last_loss = std::nan(""), last_val = std::nan(""), last_grad_norm = std::nan("");
  double max_rss = 0;
  for (int64_t epoch = start_step / steps_per_epoch; epoch < epochs; ++epoch) {
    train_sampler_->set_epoch(epoch);
    const auto epoch_start = Clock::now();
    double val_time = 0, loss_sum = 0, grad_norm_sum = 0, step_time_sum = 0, wait_sum = 0;
    int64_t epoch_steps = 0;
    RankValues values;
    const int64_t first_s =
        epoch == start_step / steps_per_epoch ? start_step % steps_per_epoch : 0;
    for (int64_t s = first_s; s < steps_per_epoch && step < total_steps; ++s) {
      const double lr = learning_rate(c_, step, total_steps);
      for (auto& group : opt.param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      }
      // --profile_out: record this step's operators, between the same two clock reads as
      // step_time (the recorder is set up before t0 and removed after the step is timed).
      const bool profiled = op_profile_ && step >= kProfileWarmupSteps &&
                            step < kProfileWarmupSteps + c_.profile_steps;
      std::optional<OpRecorder> recorder;
      if (profiled) recorder.emplace(*op_profile_);
      const auto t0 = Clock::now();
      zero_grad_to_none(opt);
      double local_loss = 0, comm_wait = 0, comm_total = 0;
      int64_t collectives = 0;
      for (int64_t m = 0; m < c_.grad_accum; ++m) {
        Batch b = load_batch(train_tokens_, *train_sampler_, s * c_.grad_accum + m);
        at::Tensor x = b.inputs.to(device_), y = b.targets.to(device_);
        auto micro_step = [&] {
          at::Tensor loss = strategy_->forward([&] { return model_->loss(x, y, c_.loss == "fused"); });
          local_loss += loss.item<double>() / static_cast<double>(c_.grad_accum);
          strategy_->backward(c_.grad_accum > 1 ? loss / static_cast<double>(c_.grad_accum) : loss);
          comm_wait += strategy_->last_step_stats().comm_wait_s;
          comm_total += strategy_->last_step_stats().comm_total_s;
          collectives += strategy_->last_step_stats().num_collectives;
        };
        if (ddp_ != nullptr && m + 1 < c_.grad_accum) {
          auto no_sync = ddp_->no_sync();
          micro_step();
        } else {
          micro_step();
        }
      }
      const double grad_norm =
          c_.clip > 0 ? strategy_->clip_grad_norm(c_.clip) : strategy_->grad_norm();
      opt.step();
      sync_device();
      const double step_time = seconds_since(t0);
      recorder.reset();
      ++step;
      if (profiled) {
        op_profile_->add_step(step_time);
        if (op_profile_->steps() == c_.profile_steps) write_profile(total_steps);
      }

      const double state_mib =
          static_cast<double>(strategy_->model_state_bytes(optimizer_state(opt))) / kMiB;
      values = gather(local_loss, state_mib);
      const double loss = values.mean_loss();
      check(std::isfinite(loss), fmt::format("loss is {} at step {}", loss, step));

      last_loss = loss;
      last_grad_norm = grad_norm;
      loss_sum += loss;
      grad_norm_sum += grad_norm;
      step_time_sum += step_time;
      wait_sum += comm_wait;
      ++epoch_steps;
      max_rss = std::max(max_rss, RankValues::max_of(values.peak_rss_mib));
      const double tokens_per_s = static_cast<double>(tokens_per_step) / step_time;
      if (rank0()) progress_->step({step, epoch + 1, loss, grad_norm, lr, tokens_per_s, step_time});

      // Mid-epoch validation (--val_every); the epoch's end always validates below.
      const bool ends_epoch = s + 1 == steps_per_epoch || step == total_steps;
      std::optional<double> val;
      if (c_.val_every > 0 && step % c_.val_every == 0 && !ends_epoch) {
        const auto v0 = Clock::now();
        val = last_val = validate();
        val_time += seconds_since(v0);
        say(fmt::format("step {}: val_loss {:.4f}", step, *val));
      }
      if (metrics_) {  // rank 0 only
        JsonLine j = base_line("step", step, epoch + 1);
        j.add("loss", loss).add("val_loss", val).add("grad_norm", grad_norm);
        j.add("tokens_per_s", tokens_per_s).add("step_time_s", step_time);
        j.add("epoch_time_s", std::optional<double>());
        j.add("peak_rss_mib", RankValues::max_of(values.peak_rss_mib));
        j.add("peak_rss_mib_per_rank", values.peak_rss_mib);
        j.add("model_state_mib", RankValues::max_of(values.model_state_mib));
        j.add("model_state_mib_per_rank", values.model_state_mib);
        j.add("comm_wait_s", comm_wait).add("comm_total_s", comm_total);
        j.add("num_collectives", collectives).add("lr", lr);
        metrics_->write(j);
      }
      // Checkpoints: every --ckpt_every steps, after the last step, and when a rank got
      // SIGTERM/SIGINT (all ranks learnt it from gather(), so they stop at the same step).
      const bool every = c_.ckpt_every > 0 && step % c_.ckpt_every == 0;
      std::string saved;
      if (!c_.ckpt_dir.empty() && (every || step == total_steps || values.stop_signal != 0)) {
        saved = save_checkpoint(opt, step);
      }
      if (values.stop_signal != 0) {
        throw std::runtime_error(fmt::format(
            "stopped by {} after step {}: {}", strsignal(values.stop_signal), step,
            saved.empty() ? std::string("no checkpoint written (no --ckpt_dir)")
                          : "checkpoint written to " + saved + "; continue with --resume"));
      }
    }
    const double epoch_time = seconds_since(epoch_start) - val_time;
    const auto v0 = Clock::now();
    const double val = last_val = validate();
    const double n = static_cast<double>(std::max<int64_t>(epoch_steps, 1));
    const double tokens_per_s =
        static_cast<double>(tokens_per_step * epoch_steps) / std::max(epoch_time, 1e-9);
    say(fmt::format(
        "epoch {}/{}: loss {:.4f} val_loss {:.4f} grad_norm {:.3f} {:.0f} tok/s "
        "{:.1f} s peak RSS {:.0f} MiB (max over ranks), model state {:.1f} MiB/rank",
        epoch + 1, epochs, loss_sum / n, val, grad_norm_sum / n, tokens_per_s, epoch_time,
        RankValues::max_of(values.peak_rss_mib), RankValues::max_of(values.model_state_mib)));
    if (metrics_) {
      JsonLine j = base_line("epoch", step, epoch + 1);
      j.add("loss", loss_sum / n).add("val_loss", val).add("grad_norm", grad_norm_sum / n);
      j.add("tokens_per_s", tokens_per_s).add("step_time_s", step_time_sum / n);
      j.add("epoch_time_s", epoch_time);
      j.add("peak_rss_mib", RankValues::max_of(values.peak_rss_mib));
      j.add("peak_rss_mib_per_rank", values.peak_rss_mib);
      j.add("model_state_mib", RankValues::max_of(values.model_state_mib));
      j.add("model_state_mib_per_rank", values.model_state_mib);
      j.add("comm_wait_s", wait_sum / n).add("validation_time_s", seconds_since(v0));
      metrics_->write(j);
    }
  }
  // Every rank, after its last batch: a rank with batches left makes every rank fail here
  // with a message naming the ranks (the split is even today; this keeps it checked).
  strategy_->finish();
  say(
      fmt::format("done: {} steps in {}; final loss {:.4f}, val_loss {:.4f}, grad_norm {:.3f}, "
                  "peak RSS {:.0f} MiB (max over ranks)",
                  step, format_duration(seconds_since(run_start)), last_loss, last_val,
                  last_grad_norm, max_rss));
  if (op_profile_ && op_profile_->steps() < c_.profile_steps) write_profile(total_steps);
  if (!c_.export_path.empty()) export_weights();
  generate_sample();
  if (comm_ && info_.world_size > 1) comm_->barrier_sync();  // no rank leaves a peer waiting
}

// --resume: the step to continue from (0 when --ckpt_dir holds no complete checkpoint).
int64_t Trainer::resume_step(torch::optim::AdamW& opt) {
  const std::string latest = dtrain::latest_checkpoint(c_.ckpt_dir);
  if (latest.empty()) {
    say(fmt::format("resume: no checkpoint in {}, starting fresh", c_.ckpt_dir));
    return 0;
  }
  dtrain::CheckpointStats stats;
  const dtrain::TrainingState state = dtrain::load_checkpoint(latest, *strategy_, &opt, {}, &stats);
  say(fmt::format("resume: step {} from {} ({:.1f} MiB read in {:.2f} s on rank 0)", state.step,
                  latest, static_cast<double>(stats.bytes) / kMiB, stats.seconds));
  return state.step;
}

std::string Trainer::save_checkpoint(torch::optim::AdamW& opt, int64_t step) {
  dtrain::CheckpointOptions o;
  o.format = c_.ckpt_format == "full" ? dtrain::CheckpointFormat::kFull
                                      : dtrain::CheckpointFormat::kSharded;
  o.keep = c_.ckpt_keep;
  dtrain::TrainingState state;
  state.step = step;
  state.values["seed"] = std::to_string(c_.seed);
  state.values["global_batch"] = std::to_string(c_.batch * info_.world_size * c_.grad_accum);
  const dtrain::CheckpointStats stats =
      dtrain::save_checkpoint(c_.ckpt_dir, *strategy_, &opt, state, o);
  say(fmt::format("checkpoint: step {} to {} ({:.1f} MiB written in {:.2f} s on rank 0)", step,
                  stats.path, static_cast<double>(stats.bytes) / kMiB, stats.seconds));
  return stats.path;
}

// --export: the full fp32 weights (gathered under FSDP, a collective) written by rank 0.
void Trainer::export_weights() {
  std::vector<std::pair<std::string, at::Tensor>> params;
  if (auto* fsdp = dynamic_cast<dtrain::FullyShardedDataParallel*>(strategy_.get())) {
    auto full = fsdp->full_state_dict();
    auto names = model_->named_parameters(true);
    for (auto& [name, t] : full) {
      if (names.contains(name)) params.emplace_back(name, t);
    }
  } else {
    for (const auto& item : model_->named_parameters(true)) {
      params.emplace_back(item.key(), item.value());
    }
  }
  if (!rank0()) return;
  export_hf_safetensors(c_.export_path, params);
  say(fmt::format("export: {} tensors in Hugging Face GPT-2 layout to {}", params.size(),
                  c_.export_path));
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

// Parent of --nproc N: starts N copies of this program as the ranks and supervises them.
// The ranks' environment gets the BLAS plan's variables.
int launch_self(int nproc, int argc, char** argv, const dtrain::BlasKernelPlan& blas) {
  dtrain::launcher::NodeOptions o;
  o.name = "gpt2_train";
  o.environment = blas.environment;
  if (blas.action == dtrain::BlasKernelPlan::Action::kSelect) {
    fmt::print("blas: {}; the ranks start with it\n", blas.note);
    std::fflush(stdout);
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  o.argv.push_back(ec ? std::string(argv[0]) : self.string());
  for (int i = 1; i < argc; ++i) o.argv.emplace_back(argv[i]);
  o.nproc_per_node = nproc;
  // With checkpoints, a forwarded SIGTERM/SIGINT is answered by a checkpoint write: give the
  // ranks time for it before SIGKILL (dtrain-run: --grace_s).
  if (!absl::GetFlag(FLAGS_ckpt_dir).empty())
    o.grace = std::max<std::chrono::milliseconds>(o.grace, std::chrono::seconds(300));
  if (const char* port = std::getenv("MASTER_PORT"); port != nullptr && *port != '\0') {
    o.master_port = std::atoi(port);
  }
  return dtrain::launcher::run_node(o);
}

}  // namespace
}  // namespace gpt2

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains GPT-2 with one strategy and reports throughput, memory, time per epoch, "
      "gradient norm and loss.\n\n"
      "  gpt2_train --strategy single --batch 8 --metrics_out single.jsonl\n"
      "  gpt2_train --strategy ddp --nproc 2 --batch 4\n"
      "  gpt2_train --strategy fsdp --nproc 2 --batch 4 --precision bf16\n"
      "  dtrain-run --nproc_per_node 2 -- gpt2_train --strategy ddp --batch 4\n\n"
      "--batch is per rank: compare strategies at the same global batch. See docs/gpt2.md.");
  absl::FlagsUsageConfig usage;
  // --help lists this file's flags (Abseil's default expects the file to be named like the
  // binary).
  usage.contains_help_flags = [](absl::string_view file) {
    return file.find("gpt2/train.cpp") != absl::string_view::npos;
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);

  const char* rank_env = std::getenv("RANK");
  const bool launched = rank_env != nullptr && *rank_env != '\0';
  int rank = 0;
  try {
    if (rest.size() > 1) {
      throw dtrain::InvalidArgument(fmt::format("unexpected argument '{}'", rest[1]));
    }
    gpt2::Config config = gpt2::config_from_flags();
    const int nproc = absl::GetFlag(FLAGS_nproc);
    gpt2::check(nproc >= 1, "--nproc must be at least 1");
    gpt2::BlasSetup blas = gpt2::blas_setup(absl::GetFlag(FLAGS_blas_kernel));
    if (!launched && nproc > 1) return gpt2::launch_self(nproc, argc, argv, blas.plan);
    if (blas.plan.action == dtrain::BlasKernelPlan::Action::kSelect) {
      gpt2::restart_with(blas, argv);
    }
    const dtrain::LaunchInfo info = dtrain::LaunchInfo::from_env();
    rank = info.rank;
    gpt2::Trainer(std::move(config), info, std::move(blas)).run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "rank {}: {}\n", rank, e.what());
    return 1;
  }
  return 0;
}

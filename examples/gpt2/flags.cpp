// gpt2_train's flags, read only here: config_from_flags() turns them into a Config once,
// checking each value, before any rank starts.
#include "flags.h"

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/flags/usage.h>
#include <absl/flags/usage_config.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/errors.h"

// Launch
ABSL_FLAG(std::string, strategy, "single",
          "single | ddp | fsdp | auto: how the model is spread over ranks. single: one process, "
          "no communication (the baseline). ddp: every rank holds the model, gradients are "
          "all-reduced in buckets during backward. fsdp: parameters, gradients and optimizer "
          "state sharded over ranks, every transformer block an FSDP unit. auto: the memory "
          "planner's choice, the first whose estimated memory per rank fits --memory_per_rank: "
          "single (one rank), else ddp, then fsdp from the least sharding (grad_op, hybrid "
          "with growing shard groups) to full; it prints the choice and every estimate. Any "
          "strategy whose estimate does not fit is refused before the model is built "
          "(docs/strategies.md, \"Memory per rank\").");
ABSL_FLAG(double, memory_per_rank, 0,
          "GiB of memory each rank may use, the memory planner's budget (0: the default: the "
          "device's memory with --device cuda; on the CPU MemAvailable or the cgroup limit, "
          "whichever is smaller, shared equally among the local ranks). A run whose estimated "
          "peak per rank exceeds it is refused up front, naming the estimate and the "
          "strategies that fit; pass a larger value to run anyway.");
ABSL_FLAG(int, nproc, 1,
          "Ranks to start on this machine. With N > 1 the program starts N copies of itself "
          "as ranks 0..N-1 (posix_spawn of /proc/self/exe with RANK, WORLD_SIZE, LOCAL_RANK, "
          "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) and waits for them. Ignored when "
          "RANK is already set (started by dtrain-run, torchrun or a cluster launcher: the "
          "process is then that rank).");
ABSL_FLAG(std::string, device, "cpu",
          "cpu | cuda. cuda: the NCCL backend (when built); a rank uses GPU LOCAL_RANK, or 0 "
          "when CUDA_VISIBLE_DEVICES shows it one GPU (docs/nccl.md, the device contract); "
          "more ranks per host than GPUs is refused.");
ABSL_FLAG(std::string, backend, "auto",
          "auto | nccl | gloo | mpi. auto: nccl with --device cuda, gloo on the CPU. gloo with "
          "--device cuda: Gloo's collectives on the GPU's tensors, staged through pinned host "
          "memory, so several ranks may share one GPU (slower than NCCL; for tests and "
          "clusters without an NCCL-capable network). nccl needs --device cuda. mpi: the job's "
          "MPI (ranks started by mpirun or srun --mpi=pmix; a dtrain built with MPI), staged "
          "the same way with --device cuda.");
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
          "Preset. GPT-2, a causal language model: tiny (4 layers, 4 heads, dim 256, ctx 128; "
          "16.1M parameters), paper-27m (6, 6, 360, 256; 27.5M), gpt2 (12, 12, 768, 1024; "
          "124M), gpt2-medium (24, 16, 1024, 1024; 355M), gpt2-large (36, 20, 1280, 1024; "
          "774M), gpt2-xl (48, 25, 1600, 1024; 1558M), Hugging Face's shapes. BERT, a masked "
          "language model (15% of positions predicted, docs/bert.md): "
          "bert-tiny (4, 4, 256, ctx 128, feed-forward 1024; 16.1M), bert (10, 7, 448, 128, "
          "1792; 46.7M). The flags below override single dimensions. BERT runs have no text "
          "sample and refuse --export and --init_from (Hugging Face GPT-2 weights).");
ABSL_FLAG(int64_t, layers, 0, "Transformer blocks (0: the preset's).");
ABSL_FLAG(int64_t, heads, 0, "Attention heads; must divide --dim (0: the preset's).");
ABSL_FLAG(int64_t, dim, 0,
          "Embedding width (0: the preset's). BERT: the feed-forward width becomes 4 x dim.");
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
          "Micro-batches per optimizer step. Gradients are reduced on the last one only (DDP "
          "and FSDP accumulate the others locally).");
ABSL_FLAG(int64_t, global_batch, 0,
          "Sequences per optimizer step over all ranks (0: batch x ranks x grad_accum). Sets "
          "--grad_accum to global_batch / (batch x ranks), which must divide evenly: the global "
          "batch, hence the data order and the learning-rate schedule, then stays the same at "
          "every world size, as an elastic run (dtrain-run --nnodes MIN:MAX) needs to resume "
          "after a world-size change.");
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
          "AdamW's decoupled weight decay on the weight matrices only (GPT-2's convention: "
          "biases, LayerNorm weights and embeddings get none), the same parameters under every "
          "strategy (FSDP steps per-parameter views of its shards).");
ABSL_FLAG(bool, fused_adamw, true,
          "Step AdamW with dtrain::FusedAdamW (one pass over each parameter's memory, the "
          "same results up to float rounding) instead of LibTorch's torch::optim::AdamW "
          "(about ten tensor operations per parameter). Checkpoints are interchangeable.");
ABSL_FLAG(double, clip, 1.0,
          "Clip the global gradient norm to this value (0: no clipping; the norm is still "
          "measured and reported).");

// Precision and communication
ABSL_FLAG(std::string, precision, "fp32",
          "fp32 | bf16 | fp16. single and ddp: ATen autocast around the forward (matmuls and "
          "linears in bf16/fp16; fp32 weights, gradients, Adam state and loss; "
          "dtrain/autocast.h). fsdp: FSDP mixed precision (param_dtype: the blocks compute in "
          "bf16/fp16 from fp32 shards; fp32 optimizer). fp16 needs --device cuda (CPU kernels "
          "lack fp16) and is loss-scaled (--loss_scale). bf16 on a CPU without native bf16 "
          "(avx512_bf16, AMX-BF16) is emulated and many times slower than fp32: it runs, with "
          "one warning (docs/gpt2.md, \"bf16 on CPUs\"). See docs/strategies.md.");
ABSL_FLAG(std::string, loss_scale, "auto",
          "auto | none | dynamic | <scale>. Multiply the loss by a scale before backward and "
          "divide the gradients by it before clipping (dtrain::GradScaler), so that small fp16 "
          "gradients do not underflow; a step whose gradients hold inf/NaN on any rank is "
          "skipped on every rank. dynamic: start at --loss_scale_init, halve on such a step, "
          "double after --loss_scale_interval clean steps. <scale>: a fixed scale. auto: "
          "dynamic with --precision fp16, none otherwise (bf16 and fp32 have fp32's range and "
          "need no scaling; a scale there only adds the inf/NaN step skipping). Saved in "
          "checkpoints.");
ABSL_FLAG(double, loss_scale_init, 65536.0, "--loss_scale dynamic: the first scale.");
ABSL_FLAG(int64_t, loss_scale_interval, 2000,
          "--loss_scale dynamic: clean steps (no inf/NaN) before the scale doubles.");
ABSL_FLAG(std::string, loss, "fused",
          "How the LM head's cross-entropy is computed. fused: chunk by chunk of rows with the "
          "gradients formed in place, never materializing the [batch, context, vocab] logits "
          "(examples/common/lm_head_loss.h) | standard: logits, then cross_entropy (autograd "
          "through both). Same loss and gradients up to fp32 rounding.");
ABSL_FLAG(std::string, comm_hook, "allreduce",
          "How gradients are reduced. ddp: allreduce (average in fp32) | fp16 | bf16 (compress "
          "to 16 bits on the wire) | ps (parameter server: rank 0 gathers, averages and "
          "broadcasts) | powersgd (low-rank compression, --powersgd_rank). fsdp: allreduce | "
          "fp16 | bf16 (FSDP's reduce_dtype).");
ABSL_FLAG(std::string, quantize_grads, "none",
          "Gradients on the wire as int8 (blockwise, an fp32 scale per 256 values) | int4 "
          "(the same blocks, half a byte per value) | bf16 | none, always added up in fp32. "
          "ddp: dtrain::quantized_allreduce_hook (replaces --comm_hook); fsdp: reduce-"
          "scattered point to point (FsdpOptions::quantize_grads). Across hosts both go in two "
          "levels: fp32 within the host, quantised between hosts.");
ABSL_FLAG(std::string, quantize_params, "none",
          "fsdp: parameters' all-gathers on the wire as int8 (blockwise) | int4 | bf16 | none "
          "(FsdpOptions::quantize_params); the fp32 shards stay exact.");
ABSL_FLAG(int32_t, powersgd_rank, 1,
          "--comm_hook powersgd: rank of the gradient approximation (1-4 typical; higher is "
          "closer to the exact gradient and sends more).");
ABSL_FLAG(int64_t, powersgd_start_iter, 10,
          "--comm_hook powersgd: optimizer steps reduced by a plain all-reduce before "
          "compression starts (at least 2).");
ABSL_FLAG(double, bucket_mb, 25.0, "ddp: gradient bucket size in MiB.");
ABSL_FLAG(std::string, sharding, "full",
          "fsdp: full (ZeRO-3: parameters freed after forward and backward) | grad_op (ZeRO-2: "
          "kept from forward to backward) | no_shard (DDP-like) | hybrid (full within groups "
          "of --shard_group_size ranks, replicated across groups).");
ABSL_FLAG(int, shard_group_size, 0, "fsdp hybrid: ranks per shard group (0: LOCAL_WORLD_SIZE).");
ABSL_FLAG(std::string, reshard_after_forward, "",
          "fsdp: where a block's parameters go after its forward (FsdpOptions::"
          "reshard_after_forward). all: freed, backward gathers over every rank | host: each "
          "rank keeps 1/LOCAL_WORLD_SIZE of them, backward gathers inside the host | none: "
          "kept until backward. Empty: --sharding's own (full, hybrid: all; grad_op, "
          "no_shard: none).");
ABSL_FLAG(std::string, prefetch, "pre",
          "fsdp backward prefetch: pre (gather the next unit when a unit's backward starts) | "
          "post (after its gradient is reduced) | none.");
ABSL_FLAG(bool, malloc_tuning, true,
          "Serve host blocks of 4 MiB and more with mmap and trim the heap (dtrain::"
          "tune_host_memory), so memory a step frees goes back to the system (lower peak RSS, "
          "most for FSDP), and start with glibc's malloc asking for transparent huge pages "
          "(GLIBC_TUNABLES glibc.malloc.hugetlb=1, unless GLIBC_TUNABLES already sets it; the "
          "process restarts itself once to apply it): fewer page faults on fresh memory. "
          "false: glibc's defaults.");
ABSL_FLAG(bool, activation_checkpointing, false,
          "Recompute every transformer block's forward during backward instead of keeping its "
          "activations: less memory, about one more forward of time (any strategy).");
ABSL_FLAG(bool, forward_prefetch, false, "fsdp: gather unit k+1 while unit k's forward runs.");
ABSL_FLAG(bool, cpu_offload, false,
          "fsdp: keep the fp32 parameter shards, their gradients and AdamW's state in host "
          "memory (pinned) and step them there; each gather copies a shard to the GPU "
          "(FsdpOptions::cpu_offload). On a CPU-only run the model is in host memory already: "
          "accepted, changes nothing, and says so.");

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
ABSL_FLAG(std::string, trace_out, "",
          "Write a Kineto trace (Chrome trace JSON, as torch.profiler's export_chrome_trace) "
          "of the --profile_steps steps that follow the first 5 here (rank 0 only): ATen "
          "operators on the host and, with --device cuda, the GPU's kernels, copies and CUDA "
          "runtime calls. Needs a LibTorch built with Kineto; the run fails at its start "
          "otherwise. Not with --profile_out. Summaries: benchmarks/trace_table.py.");
ABSL_FLAG(int64_t, profile_steps, 5,
          "With --profile_out or --trace_out: steps to profile, after the first 5 of the run.");
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
ABSL_FLAG(bool, ckpt_async, false,
          "With --ckpt_dir: write checkpoints in the background. A checkpoint blocks the step "
          "only while the state is copied to host memory (--ckpt_format full: the whole model "
          "and AdamW state on rank 0); the files are written meanwhile, in the same layout. A "
          "failed write stops the run at the next checkpoint or at the end; the run ends only "
          "after the last write is complete.");
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
ABSL_FLAG(bool, eval_only, false,
          "Evaluate, do not train: the validation loss (over --val_batches global batches) and "
          "the sample of the weights from --init_from or from --resume's checkpoint, then "
          "exit. Needs one of the two, and --resume then needs a checkpoint in --ckpt_dir.");
ABSL_FLAG(std::string, init_from, "",
          "Start from the weights of a Hugging Face GPT-2 safetensors file (e.g. gpt2's "
          "model.safetensors, or one written by --export); the model flags must match its "
          "shapes. Ignored when --resume finds a checkpoint.");

namespace gpt2 {
namespace {

// The enum value whose spelling is `value`; throws InvalidArgument(message) for another one.
template <typename E>
E choose(const std::string& value, std::initializer_list<std::pair<const char*, E>> choices,
         const std::string& message) {
  for (const auto& [name, e] : choices) {
    if (value == name) return e;
  }
  throw dtrain::InvalidArgument(message);
}

// --model and the dimension flags into c.model_kind and c.gpt or c.bert (the other keeps
// its defaults).
void read_model(Config& c) {
  c.model = absl::GetFlag(FLAGS_model);
  const int64_t layers = absl::GetFlag(FLAGS_layers), heads = absl::GetFlag(FLAGS_heads);
  const int64_t dim = absl::GetFlag(FLAGS_dim), ctx = absl::GetFlag(FLAGS_ctx);
  const bool checkpointing = absl::GetFlag(FLAGS_activation_checkpointing);
  if (bert::is_preset(c.model)) {
    c.model_kind = ModelKind::kBert;
    c.bert = bert::preset(c.model);
    if (layers > 0) c.bert.layers = layers;
    if (heads > 0) c.bert.heads = heads;
    if (dim > 0) c.bert.dim = dim, c.bert.ffn_dim = 4 * dim;
    if (ctx > 0) c.bert.context = ctx;
    c.bert.activation_checkpointing = checkpointing;
    return;
  }
  const auto names = preset_names();
  check(std::find(names.begin(), names.end(), c.model) != names.end(),
        fmt::format("--model must be a GPT-2 preset ({}) or a BERT preset ({}), got '{}'",
                    fmt::join(names, ", "), fmt::join(bert::preset_names(), ", "), c.model));
  c.model_kind = ModelKind::kGpt2;
  c.gpt = preset(c.model);
  if (layers > 0) c.gpt.layers = layers;
  c.gpt.activation_checkpointing = checkpointing;
  if (heads > 0) c.gpt.heads = heads;
  if (dim > 0) c.gpt.dim = dim;
  if (ctx > 0) c.gpt.context = ctx;
}

}  // namespace

std::vector<char*> parse_command_line(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains GPT-2 (or BERT, --model bert-tiny | bert) with one strategy and reports "
      "throughput, memory, time per epoch, gradient norm and loss.\n\n"
      "  gpt2_train --strategy single --batch 8 --metrics_out single.jsonl\n"
      "  gpt2_train --model bert-tiny --strategy fsdp --nproc 2 --batch 4\n"
      "  gpt2_train --strategy ddp --nproc 2 --batch 4\n"
      "  gpt2_train --strategy fsdp --nproc 2 --batch 4 --precision bf16\n"
      "  dtrain-run --nproc_per_node 2 -- gpt2_train --strategy ddp --batch 4\n\n"
      "--batch is per rank: compare strategies at the same global batch. See docs/gpt2.md.");
  absl::FlagsUsageConfig usage;
  // --help lists this file's flags (Abseil's default expects the file to be named like the
  // binary).
  usage.contains_help_flags = [](absl::string_view file) {
    return file.find("gpt2/flags.cpp") != absl::string_view::npos;
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  return absl::ParseCommandLine(argc, argv);
}

Config config_from_flags() {
  using dtrain::BackwardPrefetch;
  using dtrain::ShardingStrategy;
  Config c;
  read_model(c);

  const std::string strategy = absl::GetFlag(FLAGS_strategy);
  c.strategy_auto = strategy == "auto";
  c.strategy =
      choose<StrategyKind>(c.strategy_auto ? "single" : strategy,
                           {{"single", StrategyKind::kSingle},
                            {"ddp", StrategyKind::kDdp},
                            {"fsdp", StrategyKind::kFsdp}},
                           "--strategy must be single, ddp, fsdp or auto, got '" + strategy + "'");
  const double memory_gib = absl::GetFlag(FLAGS_memory_per_rank);
  check(memory_gib >= 0 && std::isfinite(memory_gib) && memory_gib < 1e9,
        "--memory_per_rank must be a non-negative number of GiB (0: the default)");
  c.memory_per_rank = static_cast<int64_t>(memory_gib * static_cast<double>(int64_t{1} << 30));
  c.device = choose<DeviceKind>(absl::GetFlag(FLAGS_device),
                                {{"cpu", DeviceKind::kCpu}, {"cuda", DeviceKind::kCuda}},
                                "--device must be cpu or cuda");
  c.backend = choose<BackendKind>(absl::GetFlag(FLAGS_backend),
                                  {{"auto", BackendKind::kAuto},
                                   {"nccl", BackendKind::kNccl},
                                   {"gloo", BackendKind::kGloo},
                                   {"mpi", BackendKind::kMpi}},
                                  "--backend must be auto, nccl, gloo or mpi");
  check(c.backend != BackendKind::kNccl || c.device == DeviceKind::kCuda,
        "--backend nccl needs --device cuda (NCCL moves only GPU tensors)");
  c.precision = choose<Precision>(
      absl::GetFlag(FLAGS_precision),
      {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}},
      "--precision must be fp32, bf16 or fp16");
  c.loss = choose<LossKind>(absl::GetFlag(FLAGS_loss),
                            {{"fused", LossKind::kFused}, {"standard", LossKind::kStandard}},
                            "--loss must be fused or standard");
  c.comm_hook = choose<CommHookKind>(absl::GetFlag(FLAGS_comm_hook),
                                     {{"allreduce", CommHookKind::kAllreduce},
                                      {"fp16", CommHookKind::kFp16},
                                      {"bf16", CommHookKind::kBf16},
                                      {"ps", CommHookKind::kParameterServer},
                                      {"powersgd", CommHookKind::kPowerSgd}},
                                     "--comm_hook must be allreduce, fp16, bf16, ps or powersgd");
  using dtrain::Quantization;
  auto quantization = [](const std::string& value, const std::string& flag) {
    return choose<Quantization>(value,
                                {{"none", Quantization::kNone},
                                 {"bf16", Quantization::kBf16},
                                 {"int8", Quantization::kInt8},
                                 {"int4", Quantization::kInt4}},
                                flag + " must be int8, int4, bf16 or none");
  };
  c.quantize_grads = quantization(absl::GetFlag(FLAGS_quantize_grads), "--quantize_grads");
  c.quantize_params = quantization(absl::GetFlag(FLAGS_quantize_params), "--quantize_params");
  check(c.quantize_grads == dtrain::Quantization::kNone || c.strategy != StrategyKind::kSingle,
        "--quantize_grads applies to --strategy ddp or fsdp");
  check(c.quantize_grads == dtrain::Quantization::kNone || c.strategy != StrategyKind::kDdp ||
            c.comm_hook == CommHookKind::kAllreduce,
        "--quantize_grads chooses ddp's comm hook itself: leave --comm_hook at allreduce");
  check(c.quantize_params == dtrain::Quantization::kNone || c.strategy == StrategyKind::kFsdp,
        "--quantize_params applies to --strategy fsdp (ddp gathers no parameters)");
  c.powersgd_rank = absl::GetFlag(FLAGS_powersgd_rank);
  c.powersgd_start_iter = absl::GetFlag(FLAGS_powersgd_start_iter);
  check(c.powersgd_rank >= 1, "--powersgd_rank must be >= 1");
  check(c.powersgd_start_iter >= 2,
        "--powersgd_start_iter must be >= 2 (DataParallel rebuilds its buckets after the first "
        "step; PowerSGD's state is made for the final ones)");
  c.sharding = choose<ShardingStrategy>(absl::GetFlag(FLAGS_sharding),
                                        {{"full", ShardingStrategy::kFullShard},
                                         {"grad_op", ShardingStrategy::kShardGradOp},
                                         {"no_shard", ShardingStrategy::kNoShard},
                                         {"hybrid", ShardingStrategy::kHybridShard}},
                                        "--sharding must be full, grad_op, no_shard or hybrid");
  const std::string reshard = absl::GetFlag(FLAGS_reshard_after_forward);
  if (!reshard.empty()) {
    c.reshard_after_forward =
        choose<dtrain::ReshardAfterForward>(reshard,
                                            {{"all", dtrain::ReshardAfterForward::kAll},
                                             {"host", dtrain::ReshardAfterForward::kHost},
                                             {"none", dtrain::ReshardAfterForward::kNone}},
                                            "--reshard_after_forward must be all, host or none");
    check(c.strategy == StrategyKind::kFsdp, "--reshard_after_forward applies to --strategy fsdp");
  }
  c.prefetch = choose<BackwardPrefetch>(absl::GetFlag(FLAGS_prefetch),
                                        {{"pre", BackwardPrefetch::kBackwardPre},
                                         {"post", BackwardPrefetch::kBackwardPost},
                                         {"none", BackwardPrefetch::kNone}},
                                        "--prefetch must be pre, post or none");
  c.tokenizer =
      choose<TokenizerKind>(absl::GetFlag(FLAGS_tokenizer),
                            {{"gpt2", TokenizerKind::kGpt2}, {"byte", TokenizerKind::kByte}},
                            "--tokenizer must be gpt2 or byte");
  check(c.precision != Precision::kFp16 || c.device == DeviceKind::kCuda,
        "--precision fp16 needs --device cuda (CPU kernels lack fp16; use bf16 on CPU)");
  if (c.strategy == StrategyKind::kFsdp || c.strategy_auto) {
    check(c.comm_hook != CommHookKind::kParameterServer && c.comm_hook != CommHookKind::kPowerSgd,
          "--comm_hook ps and powersgd are DataParallel hooks; fsdp (which --strategy auto may "
          "choose) reduces with reduce-scatter (allreduce, fp16 or bf16 reduce dtype)");
  }
  const std::string loss_scale = absl::GetFlag(FLAGS_loss_scale);
  c.loss_scale_value = absl::GetFlag(FLAGS_loss_scale_init);
  c.loss_scale_interval = absl::GetFlag(FLAGS_loss_scale_interval);
  if (loss_scale == "auto") {
    c.loss_scale = c.precision == Precision::kFp16 ? LossScaleKind::kDynamic : LossScaleKind::kNone;
  } else if (loss_scale == "none" || loss_scale == "dynamic") {
    c.loss_scale = loss_scale == "none" ? LossScaleKind::kNone : LossScaleKind::kDynamic;
  } else {
    char* end = nullptr;
    c.loss_scale_value = std::strtod(loss_scale.c_str(), &end);
    check(
        !loss_scale.empty() && end == loss_scale.c_str() + loss_scale.size() &&
            c.loss_scale_value > 0 && std::isfinite(c.loss_scale_value),
        "--loss_scale must be auto, none, dynamic or a positive number, got '" + loss_scale + "'");
    c.loss_scale = LossScaleKind::kFixed;
  }
  check(c.loss_scale_value > 0 && std::isfinite(c.loss_scale_value) && c.loss_scale_interval >= 1,
        "--loss_scale_init must be positive and --loss_scale_interval at least 1");
  // vocab_size is set from the tokenizer later; 1 keeps validate() meaningful now.
  c.gpt.vocab_size = c.bert.vocab_size = 1;
  c.gpt.validate();
  c.bert.validate();

  c.vocab = absl::GetFlag(FLAGS_vocab);
  c.batch = absl::GetFlag(FLAGS_batch);
  c.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  c.global_batch = absl::GetFlag(FLAGS_global_batch);
  c.epochs = absl::GetFlag(FLAGS_epochs);
  c.steps = absl::GetFlag(FLAGS_steps);
  c.steps_per_epoch = absl::GetFlag(FLAGS_steps_per_epoch);
  c.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  c.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  c.val_every = absl::GetFlag(FLAGS_val_every);
  c.val_batches = absl::GetFlag(FLAGS_val_batches);
  c.sample_tokens = absl::GetFlag(FLAGS_sample_tokens);
  c.top_k = absl::GetFlag(FLAGS_top_k);
  c.profile_out = absl::GetFlag(FLAGS_profile_out);
  c.profile_steps = absl::GetFlag(FLAGS_profile_steps);
  c.trace_out = absl::GetFlag(FLAGS_trace_out);
  c.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.min_lr_ratio = absl::GetFlag(FLAGS_min_lr_ratio);
  c.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  c.fused_adamw = absl::GetFlag(FLAGS_fused_adamw);
  c.clip = absl::GetFlag(FLAGS_clip);
  c.bucket_mb = absl::GetFlag(FLAGS_bucket_mb);
  c.temperature = absl::GetFlag(FLAGS_temperature);
  c.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  c.threads = absl::GetFlag(FLAGS_threads);
  c.shard_group_size = absl::GetFlag(FLAGS_shard_group_size);
  c.ckpt_every = absl::GetFlag(FLAGS_ckpt_every);
  c.ckpt_keep = absl::GetFlag(FLAGS_ckpt_keep);
  c.ckpt_dir = absl::GetFlag(FLAGS_ckpt_dir);
  c.ckpt_async = absl::GetFlag(FLAGS_ckpt_async);
  c.resume = absl::GetFlag(FLAGS_resume);
  check(c.vocab >= 0, "--vocab must not be negative");
  check(c.batch >= 1, "--batch must be at least 1");
  check(c.grad_accum >= 1, "--grad_accum must be at least 1");
  check(c.global_batch >= 0, "--global_batch must not be negative");
  check(c.global_batch == 0 || c.grad_accum == 1,
        "--global_batch sets --grad_accum; give one of the two");
  check(c.epochs >= 1, "--epochs must be at least 1");
  check(c.steps >= 0 && c.steps_per_epoch >= 0 && c.max_tokens >= 0 && c.warmup_steps >= 0 &&
            c.val_every >= 0 && c.val_batches >= 0 && c.sample_tokens >= 0 && c.top_k >= 0,
        "step, token and batch counts must not be negative");
  check((c.profile_out.empty() && c.trace_out.empty()) || c.profile_steps >= 1,
        "--profile_steps must be at least 1 with --profile_out or --trace_out");
  // Both observe the same steps' operators: each would add its cost to the other's times.
  check(c.profile_out.empty() || c.trace_out.empty(),
        "--profile_out and --trace_out profile the same steps: give one of the two");
  check(c.val_fraction >= 0 && c.val_fraction < 1, "--val_fraction must be in [0, 1)");
  check(c.lr > 0, "--lr must be positive");
  check(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, "--min_lr_ratio must be in [0, 1]");
  check(c.weight_decay >= 0 && c.clip >= 0, "--weight_decay and --clip must not be negative");
  check(c.bucket_mb > 0, "--bucket_mb must be positive");
  check(c.temperature > 0, "--temperature must be positive");
  check(c.timeout_s > 0, "--timeout_s must be positive");
  check(c.threads >= 0 && c.shard_group_size >= 0, "--threads and --shard_group_size >= 0");
  c.ckpt_format = choose<dtrain::CheckpointFormat>(
      absl::GetFlag(FLAGS_ckpt_format),
      {{"full", dtrain::CheckpointFormat::kFull}, {"sharded", dtrain::CheckpointFormat::kSharded}},
      "--ckpt_format must be full or sharded");
  check(c.ckpt_every >= 0 && c.ckpt_keep >= 1, "--ckpt_every >= 0 and --ckpt_keep >= 1");
  check(!c.resume || !c.ckpt_dir.empty(), "--resume needs --ckpt_dir");
  check(!c.ckpt_async || !c.ckpt_dir.empty(), "--ckpt_async needs --ckpt_dir");

  const std::string data = absl::GetFlag(FLAGS_data);
  c.data = data == "random" ? DataKind::kRandom : DataKind::kText;
  c.data_path = c.data == DataKind::kRandom ? std::string() : data;
  c.vocab_dir = absl::GetFlag(FLAGS_vocab_dir);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  c.metrics_out = absl::GetFlag(FLAGS_metrics_out);
  c.prompt = absl::GetFlag(FLAGS_prompt);
  c.forward_prefetch = absl::GetFlag(FLAGS_forward_prefetch);
  c.cpu_offload = absl::GetFlag(FLAGS_cpu_offload);
  check(!c.cpu_offload || c.strategy == StrategyKind::kFsdp || c.strategy_auto,
        "--cpu_offload offloads FSDP's shards; it needs --strategy fsdp (or auto)");
  c.malloc_tuning = absl::GetFlag(FLAGS_malloc_tuning);
  c.export_path = absl::GetFlag(FLAGS_export);
  c.init_from = absl::GetFlag(FLAGS_init_from);
  c.eval_only = absl::GetFlag(FLAGS_eval_only);
  check(!c.eval_only || c.resume || !c.init_from.empty(),
        "--eval_only evaluates the weights of --init_from or --resume; give one of them "
        "(without either it would evaluate freshly initialised weights)");
  check(!c.eval_only || c.val_batches > 0, "--eval_only needs --val_batches > 0");
  if (c.model_kind == ModelKind::kBert) {
    check(c.export_path.empty() && c.init_from.empty(),
          fmt::format("--export and --init_from write and read Hugging Face GPT-2 weights; "
                      "--model {} is BERT (its weights are in --ckpt_dir checkpoints)",
                      c.model));
  }

  // Checked after the rest, as main() did before the Config held them.
  c.nproc = absl::GetFlag(FLAGS_nproc);
  check(c.nproc >= 1, "--nproc must be at least 1");
  c.blas_kernel = choose<dtrain::BlasKernelPolicy>(
      absl::GetFlag(FLAGS_blas_kernel),
      {{"auto", dtrain::BlasKernelPolicy::kAuto}, {"keep", dtrain::BlasKernelPolicy::kKeep}},
      "--blas_kernel must be auto or keep");
  return c;
}

}  // namespace gpt2

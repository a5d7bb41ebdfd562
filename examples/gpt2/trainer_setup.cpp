// The trainer's set-up, in the order run() calls it: process, device and communicator,
// data, model and strategy, optimizer, schedule.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <sched.h>
#include <torch/cuda.h>
#include <torch/nn/modules/embedding.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/comm_hook.h"
#include "dtrain/deferred_init.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/fused_adamw.h"
#include "dtrain/host_memory.h"
#include "dtrain/powersgd.h"
#include "dtrain/quantization.h"
#include "dtrain/single_device.h"
#include "hf_weights.h"
#include "metrics.h"
#include "trainer.h"

namespace gpt2 {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

fs::path data_dir() {
  const char* env = std::getenv("DTRAIN_DATA_DIR");
  return env != nullptr && *env != '\0' ? fs::path(env) : fs::path(GPT2_DEFAULT_DATA_DIR);
}

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

// Intra-op threads, the BLAS note from main, and the allocator.
void Trainer::setup_process() {
  if (c_.global_batch > 0) {
    const int64_t per_micro = c_.batch * info_.world_size;
    check(c_.global_batch % per_micro == 0,
          fmt::format("--global_batch {} is not a multiple of --batch {} x {} ranks",
                      c_.global_batch, c_.batch, info_.world_size));
    c_.grad_accum = c_.global_batch / per_micro;
  }
  threads_ = c_.threads > 0 ? c_.threads : std::max(1, available_cores() / info_.local_world_size);
  at::set_num_threads(threads_);
  say("blas: " + blas_.plan.note);
  const dtrain::CpuFeatures& cpu = blas_.cpu;
  say(fmt::format("cpu: {}{} {}; cpu_bf16_native {}", cpu.model.empty() ? "" : cpu.model + ", ",
                  cpu.arch, cpu.summary(),
                  cpu.native_bf16() ? "true (" + cpu.bf16_features() + ")"
                                    : std::string("false (bf16 is emulated)")));
  if (c_.malloc_tuning) {
    const bool tuned = dtrain::tune_host_memory();
    say(tuned ? fmt::format("host memory: blocks >= 4 MiB from mmap, heap trimmed above 4 MiB, "
                            "huge pages {} (--malloc_tuning=false: glibc's defaults)",
                            dtrain::malloc_huge_pages_requested() ? "requested" : "not requested")
              : "host memory: glibc refused the tuning; running with its defaults");
  }
}

void Trainer::setup_device_and_comm() {
  dtrain::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(c_.timeout_s);
  if (c_.backend == BackendKind::kMpi) options.backend = dtrain::Backend::kMpi;
  if (c_.device == DeviceKind::kCuda) {
    check(torch::cuda::is_available(), "--device cuda: LibTorch sees no CUDA device");
    if (c_.backend == BackendKind::kAuto || c_.backend == BackendKind::kNccl) {
      options.backend = dtrain::Backend::kNccl;
    }
    // The device contract (dtrain/rendezvous.h): LOCAL_RANK, or device 0 when
    // CUDA_VISIBLE_DEVICES narrows this rank to one GPU; NCCL ranks sharing one is refused.
    const int index = info_.cuda_device(dtrain::cuda_device_count(), options.backend);
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    options.device_index = index;
    // Gloo and MPI on CUDA tensors: staged through host memory (CommunicatorOptions::device).
    if (options.backend != dtrain::Backend::kNccl) options.device = device_;
  }
  comm_options_ = options;
  // Provisional until plan_memory(): several ranks need the communicator either way.
  if (c_.strategy_auto) {
    c_.strategy = info_.world_size > 1 ? StrategyKind::kDdp : StrategyKind::kSingle;
  }
  if (c_.strategy == StrategyKind::kSingle) {
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
  const std::string tokenizer = to_string(c_.tokenizer);
  // Random tokens need no vocabulary: without GPT-2's files the model gets GPT-2's size and
  // the run ends without a sample.
  if (c_.data != DataKind::kRandom || c_.tokenizer != TokenizerKind::kGpt2 ||
      has_gpt2_vocabulary(vocab_dir)) {
    tokenizer_ = make_tokenizer(tokenizer, vocab_dir);
  }
  const int64_t ids = tokenizer_ ? tokenizer_->vocab_size() : kGpt2VocabSize;
  token_ids_ = ids;  // the model's rows follow from it (make_task)

  TokenView tokens;
  if (c_.data == DataKind::kRandom) {
    tokens = make_random_tokens(c_.max_tokens > 0 ? c_.max_tokens : int64_t{1} << 20, ids,
                                static_cast<uint64_t>(c_.seed));
    say(fmt::format("data: {} random tokens", tokens.size()));
  } else {
    const fs::path source = c_.data_path.empty() ? dir / "sotu.txt" : fs::path(c_.data_path);
    check(fs::exists(source), "no corpus at " + source.string() +
                                  " (run scripts/fetch-data.sh, set DTRAIN_DATA_DIR, or pass "
                                  "--data PATH or --data random)");
    // The first local rank tokenizes (once, into the cache); the others then read the cache.
    LoadedTokens loaded;
    if (info_.local_rank == 0) {
      const auto t0 = Clock::now();
      loaded = load_tokens(source, *tokenizer_);
      if (!loaded.from_cache) {
        say(fmt::format("data: tokenized {} in {:.1f} s", source.string(),
                        std::chrono::duration<double>(Clock::now() - t0).count()));
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
  so.seq_len = c_.context();
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
    say(fmt::format(
        "data: validation disabled: the validation split ({} tokens) holds no global batch",
        val_tokens_.size()));
  }
}

std::vector<int64_t> Trainer::every_rank(double mine) {
  std::vector<int64_t> all = {std::llround(mine)};
  if (comm_ && info_.world_size > 1) {
    at::Tensor in = at::full({1}, mine, at::TensorOptions().dtype(at::kDouble)).to(comm_->device());
    at::Tensor out = at::empty({info_.world_size}, in.options());
    comm_->all_gather_sync(out, in);
    out = out.cpu();
    all.clear();
    for (int64_t i = 0; i < info_.world_size; ++i) {
      all.push_back(std::llround(out.data_ptr<double>()[i]));
    }
  }
  return all;
}

namespace {

// This process's resident memory now (VmRSS), in MiB; -1 when /proc does not say.
double current_rss_mib() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  double kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "VmRSS:", 6) == 0) {
      kib = std::strtod(line + 6, nullptr);
      break;
    }
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib / 1024.0;
}

}  // namespace

void Trainer::setup_model_and_strategy() {
  const auto setup_start = std::chrono::steady_clock::now();
  // What the process held before the model (libraries, data): the set-up line's baseline.
  const double rss_before_model = current_rss_mib();
  at::manual_seed(static_cast<uint64_t>(c_.seed));  // identical initial weights on every rank
  // GPT-2 starts from param_init's values under every strategy: each parameter from its own
  // generator (seed, name). FSDP builds the model deferred and computes only this rank's
  // shards of them (dtrain/deferred_init.h); --init_from then streams each rank's shards out
  // of the file once the strategy is built (load_hf_safetensors), so no rank ever holds the
  // whole model.
  const bool gpt = c_.model_kind == ModelKind::kGpt2;
  const bool deferred = gpt && c_.strategy == StrategyKind::kFsdp;
  task_ = make_task(c_, token_ids_, device_, deferred);
  std::optional<dtrain::DeferredInit> gpt_init;
  if (gpt) {
    gpt_init = param_init(task_->gpt()->config(), static_cast<uint64_t>(c_.seed));
    // Values --init_from overwrites: zeros, not the random draws.
    if (!c_.init_from.empty()) {
      gpt_init->init = [](const std::string&, at::Tensor& p, at::Generator&) { p.zero_(); };
    }
    if (!deferred) dtrain::init_parameters(*task_->module(), *gpt_init);
  }
  say("model: " + task_->describe() + (deferred ? ", deferred initialisation" : ""));
  std::shared_ptr<torch::nn::Module> module = task_->module();

  // bf16 on a CPU without native bf16: warned once for the job below, not by each rank's
  // library objects.
  dtrain::Bf16CpuCheck quiet_bf16_check;
  quiet_bf16_check.warn = false;
  // Several hosts of several ranks: quantised gradients then go in two levels over the
  // host group, hosts as the launcher numbers them (LOCAL_WORLD_SIZE consecutive ranks).
  const bool across_hosts =
      store_ != nullptr && info_.local_world_size > 1 && info_.local_world_size < info_.world_size;
  auto make_host_group = [&] {
    return dtrain::make_host_group(store_, info_.rank, info_.world_size, info_.local_world_size,
                                   info_.communicator_options(comm_options_));
  };
  std::string details;
  switch (c_.strategy) {
    case StrategyKind::kSingle: {
      dtrain::SingleDeviceOptions o;
      o.device = device_;
      strategy_ = std::make_shared<dtrain::SingleDevice>(module, o);
      break;
    }
    case StrategyKind::kDdp: {
      dtrain::DataParallelOptions o;
      o.bucket_cap_mb = c_.bucket_mb;
      if (c_.comm_hook == CommHookKind::kFp16) o.comm_hook = dtrain::fp16_compress_hook();
      if (c_.comm_hook == CommHookKind::kBf16) o.comm_hook = dtrain::bf16_compress_hook();
      if (c_.comm_hook == CommHookKind::kParameterServer) {
        o.comm_hook = dtrain::parameter_server_hook(0);
      }
      if (c_.comm_hook == CommHookKind::kPowerSgd) {
        dtrain::PowerSgdOptions p;
        p.rank = c_.powersgd_rank;
        p.start_iter = c_.powersgd_start_iter;
        p.seed = static_cast<uint64_t>(c_.seed);
        o.comm_hook = dtrain::powersgd_hook(p);
      }
      if (c_.quantize_grads != dtrain::Quantization::kNone) {
        o.comm_hook =
            dtrain::quantized_allreduce_hook(c_.quantize_grads, dtrain::kDefaultQuantizationBlock,
                                             across_hosts ? make_host_group() : nullptr);
      }
      strategy_ = std::make_shared<dtrain::DataParallel>(module, comm_, o);
      details =
          fmt::format(", comm hook {}, buckets {} MiB", to_string(c_.comm_hook), c_.bucket_mb);
      if (c_.quantize_grads != dtrain::Quantization::kNone) {
        details += fmt::format(", gradients {} on the wire", to_string(c_.quantize_grads));
        if (across_hosts) {
          details += fmt::format(" (in two levels over hosts of {} ranks)", info_.local_world_size);
        }
      }
      if (c_.comm_hook == CommHookKind::kPowerSgd) {
        details +=
            fmt::format(" (rank {}, from step {})", c_.powersgd_rank, c_.powersgd_start_iter);
      }
      break;
    }
    case StrategyKind::kFsdp: {
      dtrain::FsdpOptions o;
      o.wrap_policy = task_->wrap_policy();
      o.sharding = c_.sharding;
      o.backward_prefetch = c_.prefetch;
      o.forward_prefetch = c_.forward_prefetch;
      o.cpu_offload = c_.cpu_offload;
      o.use_orig_params = true;  // per-parameter views: AdamW's groups (setup_optimizer)
      if (deferred) o.deferred_init = gpt_init;
      if (c_.precision == Precision::kBf16) o.mixed_precision.param_dtype = at::kBFloat16;
      if (c_.precision == Precision::kFp16) o.mixed_precision.param_dtype = at::kHalf;
      o.mixed_precision.cpu_check = quiet_bf16_check;
      // Token ids in, every parameter in param_dtype: nothing to cast, and autocast would move
      // softmax and layer_norm to fp32 on CUDA (other numbers than the measured runs').
      o.mixed_precision.cast_forward_inputs = false;
      if (c_.comm_hook == CommHookKind::kBf16) o.mixed_precision.reduce_dtype = at::kBFloat16;
      if (c_.comm_hook == CommHookKind::kFp16) o.mixed_precision.reduce_dtype = at::kHalf;
      o.quantize_params = c_.quantize_params;
      o.quantize_grads = c_.quantize_grads;
      o.reshard_after_forward = c_.reshard_after_forward;
      // The mesh: host groups where the options use them, HYBRID_SHARD's two dimensions.
      // The same backend and device as the world's communicator.
      dtrain::DeviceMeshOptions mesh_options;
      mesh_options.comm = info_.communicator_options(comm_options_);
      if (c_.reshard_after_forward == dtrain::ReshardAfterForward::kHost) {
        check(store_ != nullptr,
              "--reshard_after_forward host needs several ranks (a launched job)");
      }
      if (c_.reshard_after_forward == dtrain::ReshardAfterForward::kHost ||
          (c_.quantize_grads != dtrain::Quantization::kNone && across_hosts)) {
        mesh_options.local_world_size = info_.local_world_size;
      }
      if (o.sharding == dtrain::ShardingStrategy::kHybridShard) {
        const int group = c_.shard_group_size > 0 ? c_.shard_group_size : info_.local_world_size;
        check(store_ != nullptr && info_.world_size % group == 0,
              fmt::format("--sharding hybrid needs several ranks and a world size ({}) that is a "
                          "multiple of the shard group size ({})",
                          info_.world_size, group));
        mesh_options.shard_size = group;
      }
      const dtrain::DeviceMesh mesh =
          mesh_options.shard_size != 0 || mesh_options.local_world_size != 0
              ? dtrain::DeviceMesh::create(store_, comm_, mesh_options)
              : dtrain::DeviceMesh(comm_);
      strategy_ = std::make_shared<dtrain::FullyShardedDataParallel>(module, mesh, o);
      details =
          fmt::format(", sharding {}, prefetch {}, reduce {}", sharding_flag_name(c_.sharding),
                      prefetch_flag_name(c_.prefetch), to_string(c_.comm_hook));
      if (c_.quantize_params != dtrain::Quantization::kNone) {
        details += fmt::format(", parameters {} on the wire", to_string(c_.quantize_params));
      }
      if (c_.quantize_grads != dtrain::Quantization::kNone) {
        details += fmt::format(", gradients {} on the wire", to_string(c_.quantize_grads));
        const int shard_size =
            o.sharding == dtrain::ShardingStrategy::kNoShard ? 1 : mesh.shard_group()->world_size();
        if (across_hosts && info_.local_world_size < shard_size) {
          details += fmt::format(" (in two levels over hosts of {} ranks)", info_.local_world_size);
        }
      }
      if (c_.reshard_after_forward == dtrain::ReshardAfterForward::kHost) {
        details += fmt::format(", resharded after forward within hosts of {} ranks",
                               info_.local_world_size);
      }
      break;
    }
  }
  if (!c_.init_from.empty()) {  // GPT-2 only (flags.cpp)
    const HfLoadStats loaded = load_hf_safetensors(c_.init_from, *strategy_);
    // What rank 0 read of the file: under FSDP about 1/N of it (its shards' bytes).
    say(fmt::format(
        "model: initialized from {} ({} tensors, {:.2f} of the file's {:.2f} MiB "
        "read on rank 0)",
        c_.init_from, loaded.tensors, static_cast<double>(loaded.bytes_read) / (1 << 20),
        static_cast<double>(std::filesystem::file_size(c_.init_from)) / (1 << 20)));
  }
  if (c_.cpu_offload && c_.strategy != StrategyKind::kFsdp) {
    say("note: --cpu_offload ignored: --strategy auto chose " + strategy_->name() +
        ", which holds no shards to offload");
  } else if (c_.cpu_offload && device_.is_cpu()) {
    say("note: --cpu_offload changes nothing on this CPU-only run: the shards, gradients and "
        "optimizer state are in host memory already");
  } else if (c_.cpu_offload) {
    details += ", shards offloaded to host memory";
  }
  // The time a large model takes to be built, initialised (or loaded) and sharded, and every
  // rank's peak RSS until now: the numbers bench-model-size.sh records.
  const double setup_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();
  const std::vector<int64_t> peaks = every_rank(peak_rss_mib());
  const std::vector<int64_t> before = every_rank(rss_before_model);
  say(fmt::format(
      "model: built, initialised and wrapped in {:.2f} s; peak RSS per rank {} MiB ({} MiB "
      "before the model)",
      setup_s, fmt::join(peaks, ", "), fmt::join(before, ", ")));
  if (c_.autocast()) {
    autocast_ = dtrain::Autocast{device_.type(), c_.precision == Precision::kBf16
                                                     ? c10::ScalarType::BFloat16
                                                     : c10::ScalarType::Half};
    autocast_->cpu_check = quiet_bf16_check;
    dtrain::check_autocast(*autocast_);
    details += fmt::format(", autocast {}", to_string(c_.precision));
  }
  // It runs (bf16's numerics may be the point), but the user learns the price first.
  if (c_.precision == Precision::kBf16 && device_.is_cpu() && rank0()) {
    const std::string warning = dtrain::bf16_emulation_warning(blas_.cpu);
    if (!warning.empty()) {
      fmt::print(stderr, "warning: --precision bf16: {} See docs/gpt2.md, \"bf16 on CPUs\".\n",
                 warning);
      std::fflush(stderr);
    }
  }
  say(fmt::format("strategy: {} on {} rank(s), device {}, precision {}{}", strategy_->name(),
                  info_.world_size, device_.str(), to_string(c_.precision), details));
}

// AdamW over what the strategy steps (FSDP: per-parameter views of its fp32 shards) in two
// groups, as GPT-2 is trained: --weight_decay on the weight matrices, none on biases,
// LayerNorm weights and embedding tables; the same groups under every strategy. Then the
// loss scaler, which agrees on skipped steps over every rank (comm_, also under hybrid
// sharding).
void Trainer::setup_optimizer() {
  std::set<std::string> embeddings;  // decided by module type: GPT-2's wte/wpe, BERT's tables
  for (const auto& item : task_->module()->named_modules()) {
    if (item.value()->as<torch::nn::Embedding>() != nullptr) {
      embeddings.insert(item.key() + ".weight");
    }
  }
  std::vector<at::Tensor> decay, exempt;
  int64_t decay_numel = 0, exempt_numel = 0;
  for (const auto& p : strategy_->named_parameters()) {
    // The full shape: under FSDP the tensor is this rank's 1-D part of the parameter.
    const bool decays = p.shape.size() >= 2 && embeddings.count(p.name) == 0;
    (decays ? decay : exempt).push_back(p.tensor);
    (decays ? decay_numel : exempt_numel) += c10::multiply_integers(p.shape);
  }
  auto options = [&](double weight_decay) {
    return torch::optim::AdamWOptions(c_.lr)
        .betas({0.9, 0.95})
        .eps(1e-8)
        .weight_decay(weight_decay);
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay);
  groups.emplace_back(exempt, std::make_unique<torch::optim::AdamWOptions>(options(0)));
  const auto defaults = options(c_.weight_decay);
  if (c_.fused_adamw) {
    optimizer_ = std::make_unique<dtrain::FusedAdamW>(std::move(groups), defaults);
  } else {
    optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), defaults);
  }
  say(
      fmt::format("optimizer: AdamW{}, weight decay {} on {} matrices ({:.2f}M), 0 on {} "
                  "biases, norm weights and embeddings ({:.2f}M)",
                  c_.fused_adamw ? " (fused)" : "", c_.weight_decay, decay.size(),
                  static_cast<double>(decay_numel) / 1e6, exempt.size(),
                  static_cast<double>(exempt_numel) / 1e6));
  if (c_.loss_scale == LossScaleKind::kNone) return;
  dtrain::GradScalerOptions o;
  o.init_scale = c_.loss_scale_value;
  o.dynamic = c_.loss_scale == LossScaleKind::kDynamic;
  o.growth_interval = c_.loss_scale_interval;
  scaler_ = std::make_unique<dtrain::GradScaler>(comm_, o);
  say(o.dynamic
          ? fmt::format("loss scale: dynamic from {}, x2 after {} clean steps, x0.5 on "
                        "inf/NaN (skipped)",
                        o.init_scale, o.growth_interval)
          : fmt::format("loss scale: fixed {} (steps with inf/NaN are skipped)", o.init_scale));
}

Trainer::Schedule Trainer::plan_schedule() {
  Schedule s;
  const int64_t micro_per_epoch = train_sampler_->steps_per_epoch();
  s.steps_per_epoch = micro_per_epoch / c_.grad_accum;
  if (c_.steps_per_epoch > 0) s.steps_per_epoch = std::min(s.steps_per_epoch, c_.steps_per_epoch);
  check(s.steps_per_epoch > 0,
        fmt::format("an epoch holds {} global micro-batches, fewer than --grad_accum {}",
                    micro_per_epoch, c_.grad_accum));
  s.total_steps = c_.steps > 0 ? c_.steps : c_.epochs * s.steps_per_epoch;
  s.epochs = (s.total_steps + s.steps_per_epoch - 1) / s.steps_per_epoch;
  const int64_t global_batch = c_.batch * info_.world_size * c_.grad_accum;
  s.tokens_per_step = global_batch * c_.context();
  say(
      fmt::format("schedule: {} train / {} val tokens; {} steps in {} epoch(s) of up to {} steps; "
                  "global batch {} sequences x {} tokens; {} thread(s) per rank",
                  train_tokens_.size(), val_tokens_.size(), s.total_steps, s.epochs,
                  s.steps_per_epoch, global_batch, c_.context(), threads_));
  return s;
}

}  // namespace gpt2

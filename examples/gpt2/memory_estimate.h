// gpt2_train's models as the memory planner (dtrain/memory_plan.h) sees them, before they are
// built: parameter counts, the FSDP units of each task's wrap policy (task.h), and the
// activations one rank keeps for backward. The formulas are in docs/strategies.md, "Memory
// per rank"; the planner's run-time side is Trainer::plan_memory (trainer_setup.cpp).
#pragma once

#include <cstdint>

#include "dtrain/memory_plan.h"
#include "train_config.h"

namespace gpt2 {

// Bytes of activations kept at the peak of one micro-batch of `batch` sequences of
// `seq_len` tokens through `layers` transformer layers of width `dim`, feed-forward width
// `ffn`, `heads` heads, computing in `compute_bytes` per element (4 fp32, 2 bf16/fp16):
// per layer and token 8*dim bytes of fp32 residual stream, (6*dim + 2*ffn) compute-dtype
// elements (LayerNorm outputs, q/k/v, attention output, the MLP's two activations) and
// the heads' attention probabilities (fp32, plus a compute-dtype copy below fp32; with
// `fused_attention` only one fp32 log-sum-exp per head), one layer more for backward's
// transient gradients; with `checkpointing` only every layer's input, plus one layer
// recomputed.
int64_t transformer_activation_bytes(int64_t batch, int64_t seq_len, int64_t layers, int64_t dim,
                                     int64_t ffn, int64_t heads, int64_t compute_bytes,
                                     bool checkpointing, bool fused_attention);

// Bytes of the LM head's loss over `rows` predicted positions and `vocab` rows: the fused
// loss's fp32 chunk buffer (at most 128 MiB, lm_head_loss.h), or the standard loss's
// logits, fp32 log-softmax and fp32 gradient.
int64_t lm_loss_bytes(int64_t rows, int64_t vocab, int64_t compute_bytes, bool fused);

// The model of `c` with `vocab` embedding rows (make_task's), as the planner sees it.
dtrain::ModelMemory model_memory(const Config& c, int64_t vocab);

// How `c` trains it at `world_size` ranks: precision, AdamW, gradient accumulation, DDP's
// bucket, FSDP's units gathered at once (one more with --forward_prefetch), --cpu_offload
// (on CUDA only: on the CPU it changes nothing), and the runtime (kCpuRuntimeBytes on the
// CPU; on CUDA kCudaRuntimeBytes of device memory).
dtrain::TrainingMemory training_memory(const Config& c, int world_size);

// Device memory a CUDA process holds beyond what the caching allocator hands out (its
// context, the allocator's rounding and reserve): an allowance, not yet measured on a GPU.
inline constexpr int64_t kCudaRuntimeBytes = int64_t{1} << 30;

}  // namespace gpt2

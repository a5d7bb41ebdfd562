#include "memory_estimate.h"

#include <algorithm>

#include "bert_model.h"
#include "dtrain/attention.h"
#include "mlm_data.h"
#include "model.h"

namespace gpt2 {
namespace {

constexpr int64_t kFp32 = 4;
constexpr int64_t kLossChunkBytes = int64_t{128} << 20;  // lm_head_loss.cpp's kChunkBytes

int64_t compute_bytes(const Config& c) { return c.precision == Precision::kFp32 ? 4 : 2; }

}  // namespace

int64_t transformer_activation_bytes(int64_t batch, int64_t seq_len, int64_t layers, int64_t dim,
                                     int64_t ffn, int64_t heads, int64_t compute_bytes,
                                     bool checkpointing, bool fused_attention) {
  const int64_t tokens = batch * seq_len;
  const int64_t probs =
      fused_attention ? heads * kFp32
                      : heads * seq_len * (kFp32 + (compute_bytes < kFp32 ? compute_bytes : 0));
  const int64_t layer = 2 * kFp32 * dim + compute_bytes * (6 * dim + 2 * ffn) + probs;
  // ln_f's output and the hidden state's gradient, fp32.
  const int64_t head = 2 * kFp32 * dim;
  const int64_t kept = checkpointing ? layers * kFp32 * dim + layer : layers * layer;
  return tokens * (kept + layer + head);
}

int64_t lm_loss_bytes(int64_t rows, int64_t vocab, int64_t compute_bytes, bool fused) {
  if (!fused) return rows * vocab * (compute_bytes + 2 * kFp32);
  const int64_t chunk = std::min(rows, std::max<int64_t>(1, kLossChunkBytes / (kFp32 * vocab)));
  return chunk * vocab * kFp32;
}

dtrain::ModelMemory model_memory(const Config& c, int64_t vocab) {
  dtrain::ModelMemory m;
  const int64_t cb = compute_bytes(c);
  if (c.model_kind == ModelKind::kGpt2) {
    GptConfig g = c.gpt;
    g.vocab_size = vocab;
    m.parameters = count_parameters(g);
    const int64_t d = g.dim;
    // GptTask::wrap_policy: every block; the tied embedding too with the fused loss.
    m.units.assign(static_cast<size_t>(g.layers), 12 * d * d + 13 * d);
    if (c.fused_loss()) m.units.push_back(vocab * d);
    m.activation_bytes =
        transformer_activation_bytes(c.batch, g.context, g.layers, d, 4 * d, g.heads, cb,
                                     g.activation_checkpointing,
                                     g.fused_attention && dtrain::has_fused_attention()) +
        lm_loss_bytes(c.batch * g.context, vocab, cb, c.fused_loss());
    return m;
  }
  bert::BertConfig b = c.bert;
  b.vocab_size = vocab;
  m.parameters = bert::count_parameters(b);
  const int64_t d = b.dim, f = b.ffn_dim;
  // BERT's task (bert_task.cpp) makes every TransformerEncoderLayer a unit.
  m.units.assign(static_cast<size_t>(b.layers), 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d);
  bert::MaskingOptions masking;
  const int64_t predicted = c.batch * bert::predicted_per_sequence(b.context, masking);
  m.activation_bytes =
      transformer_activation_bytes(c.batch, b.context, b.layers, d, f, b.heads, cb,
                                   b.activation_checkpointing,
                                   b.fused_attention && dtrain::has_fused_attention()) +
      lm_loss_bytes(predicted, vocab, cb, c.fused_loss());
  return m;
}

dtrain::TrainingMemory training_memory(const Config& c, int world_size) {
  dtrain::TrainingMemory t;
  t.world_size = world_size;
  t.compute_bytes = compute_bytes(c);
  t.optimizer_states = 2;  // AdamW's two moments, fused or not
  t.accumulates = c.grad_accum > 1;
  t.bucket_bytes = static_cast<int64_t>(c.bucket_mb * static_cast<double>(1 << 20));
  t.gathered_units = c.forward_prefetch ? 3 : 2;
  t.runtime_bytes = c.device == DeviceKind::kCuda ? kCudaRuntimeBytes : dtrain::kCpuRuntimeBytes;
  // On the CPU offload changes nothing (the shards are in host memory already).
  t.cpu_offload = c.cpu_offload && c.device == DeviceKind::kCuda;
  return t;
}

}  // namespace gpt2

// What gpt2_train trains, behind one interface: the model, which of its submodules FSDP makes
// units, the batches it learns from and its loss. The trainer's loop, strategies,
// checkpoints and metrics are the same for every task.
//
//   GPT-2 (--model tiny | paper-27m | gpt2): a causal language model; batches are the
//     sampler's sequences and the next tokens; FSDP units are the blocks (BlockImpl).
//   BERT (--model bert-tiny | bert): a masked language model (bert_model.h); batches are the
//     sampler's sequences masked as BERT does (mlm_data.h); FSDP units are LibTorch's stock
//     TransformerEncoderLayers, found in their Sequential with no model edit. Its task lives
//     with the model, in namespace bert (examples/bert/bert_task.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>

#include "data.h"
#include "dtrain/fsdp.h"
#include "model.h"
#include "train_config.h"

namespace gpt2 {

class Task {
 public:
  virtual ~Task() = default;

  // The model, as the strategy wraps it.
  virtual std::shared_ptr<torch::nn::Module> module() const = 0;
  // The submodules FullyShardedDataParallel makes units.
  virtual dtrain::WrapPolicy wrap_policy() const = 0;
  // One line for the log: the preset, its dimensions and its parameter count.
  virtual std::string describe() const = 0;
  // This rank's batch of `step` in the sampler's current epoch (CPU tensors).
  virtual Batch load_batch(const TokenView& tokens, const DistributedSampler& sampler,
                           int64_t step) const = 0;
  // The loss of a batch already on the model's device, an fp32 scalar. Every task's loss is
  // a mean over equally many predictions per sequence, so the mean over ranks of their
  // losses is the global batch's loss (DDP and FSDP match single-device training).
  virtual at::Tensor loss(const at::Tensor& inputs, const at::Tensor& targets, bool fused) = 0;
  // The GPT-2 model when this task trains one (text sampling, Hugging Face GPT-2 weights);
  // an empty holder otherwise.
  virtual Gpt gpt() const { return Gpt(nullptr); }
};

// One line for the log of a task's model: "<preset> (<dims>), <params>M parameters" and
// whether its activations are checkpointed.
std::string describe_model(const std::string& preset, const std::string& dims, int64_t params,
                           bool checkpointing);

// Embedding rows of c's model: --vocab, else the tokenizer's ids (GPT-2) or the ids plus one
// for [MASK] (BERT). Throws dtrain::InvalidArgument when --vocab leaves too few rows.
int64_t embedding_rows(const Config& c, int64_t token_ids);

// Builds c.model_kind's model on `device` from the current default generator (seed it first
// for the same weights on every rank); with `deferred` (GPT-2 only) its parameters are
// deferred instead (GptConfig::deferred), for FSDP's deferred initialisation. `token_ids`: the
// tokenizer's ids. Embedding rows:
// --vocab, else the tokenizer's ids (GPT-2) or the ids plus one for [MASK] (BERT, whose
// [MASK] id is `token_ids`). Throws dtrain::InvalidArgument when --vocab leaves too few rows.
std::unique_ptr<Task> make_task(const Config& c, int64_t token_ids, c10::Device device,
                                bool deferred = false);

}  // namespace gpt2

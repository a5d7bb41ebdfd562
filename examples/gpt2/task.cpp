// The GPT-2 task (next-token prediction), and the choice between it and BERT's
// (examples/bert/bert_task.h: masked-language modelling).
#include "task.h"

#include <utility>

#include <fmt/format.h>

#include "bert_task.h"

namespace gpt2 {

std::string describe_model(const std::string& preset, const std::string& dims, int64_t params,
                           bool checkpointing) {
  return fmt::format("{} ({}), {:.2f}M parameters{}", preset, dims,
                     static_cast<double>(params) / 1e6,
                     checkpointing ? ", activation checkpointing" : "");
}

namespace {

class GptTask : public Task {
 public:
  GptTask(std::string preset, const GptConfig& config, bool fused_loss, c10::Device device)
      : preset_(std::move(preset)), model_(config), fused_loss_(fused_loss) {
    model_->to(device);
  }
  std::shared_ptr<torch::nn::Module> module() const override { return model_.ptr(); }
  // Every block; with the fused loss also the tied token embedding, which neither of its
  // uses then needs in backward (GptImpl::hidden, GptImpl::loss): as a unit it is freed
  // after forward instead of staying gathered, as the root, through the whole step. With the
  // standard loss the head's backward needs it, so it stays in the root (gathered once).
  dtrain::WrapPolicy wrap_policy() const override {
    auto blocks = dtrain::wrap_modules_named("BlockImpl");
    if (!fused_loss_) return blocks;
    return [blocks](const std::string& name, const torch::nn::Module& m) {
      return name == "wte" || blocks(name, m);
    };
  }
  std::string describe() const override {
    const GptConfig& g = model_->config();
    return describe_model(preset_, g.to_string(), count_parameters(g), g.activation_checkpointing);
  }
  Batch load_batch(const TokenView& tokens, const DistributedSampler& sampler,
                   int64_t step) const override {
    return gpt2::load_batch(tokens, sampler, step);
  }
  at::Tensor loss(const at::Tensor& inputs, const at::Tensor& targets, bool fused) override {
    return model_->loss(inputs, targets, fused);
  }
  Gpt gpt() const override { return model_; }

 private:
  std::string preset_;
  Gpt model_;
  bool fused_loss_;
};

}  // namespace

int64_t embedding_rows(const Config& c, int64_t token_ids) {
  // BERT needs one row past the tokenizer's ids for [MASK].
  const int64_t needed = c.model_kind == ModelKind::kBert ? token_ids + 1 : token_ids;
  const int64_t vocab = c.vocab > 0 ? c.vocab : needed;
  check(vocab >= needed, fmt::format("--vocab {} is smaller than the {} tokenizer's {} ids{}",
                                     vocab, to_string(c.tokenizer), token_ids,
                                     c.model_kind == ModelKind::kBert ? " plus [MASK]" : ""));
  return vocab;
}

std::unique_ptr<Task> make_task(const Config& c, int64_t token_ids, c10::Device device,
                                bool deferred) {
  const int64_t vocab = embedding_rows(c, token_ids);
  check(!deferred || c.model_kind == ModelKind::kGpt2, "deferred parameters: GPT-2 only");
  if (c.model_kind == ModelKind::kGpt2) {
    GptConfig g = c.gpt;
    g.vocab_size = vocab;
    g.deferred = deferred;
    g.deferred_device = device;
    return std::make_unique<GptTask>(c.model, g, c.fused_loss(), device);
  }
  bert::BertConfig b = c.bert;
  b.vocab_size = vocab;
  bert::MaskingOptions m;
  m.mask_id = token_ids;
  m.random_vocab = token_ids;
  m.seed = static_cast<uint64_t>(c.seed);
  return bert::make_bert_task(c.model, b, m, device);
}

}  // namespace gpt2

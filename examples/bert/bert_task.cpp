#include "bert_task.h"

#include <utility>

#include <fmt/format.h>

namespace bert {
namespace {

class BertTask : public gpt2::Task {
 public:
  BertTask(std::string preset, const BertConfig& config, const MaskingOptions& masking,
           c10::Device device)
      : preset_(std::move(preset)), model_(config), masking_(masking) {
    model_->to(device);
  }
  std::shared_ptr<torch::nn::Module> module() const override { return model_.ptr(); }
  // The stock layers, entries of model_->layers: FSDP routes them itself.
  dtrain::WrapPolicy wrap_policy() const override {
    return dtrain::wrap_modules_named("TransformerEncoderLayer");
  }
  std::string describe() const override {
    const BertConfig& b = model_->config();
    return gpt2::describe_model(preset_, b.to_string(), count_parameters(b),
                                b.activation_checkpointing) +
           fmt::format("; masked LM: {} of {} positions predicted, [MASK] id {}",
                       predicted_per_sequence(b.context, masking_), b.context, masking_.mask_id);
  }
  gpt2::Batch load_batch(const gpt2::TokenView& tokens, const gpt2::DistributedSampler& sampler,
                         int64_t step) const override {
    return load_mlm_batch(tokens, sampler, step, masking_);
  }
  at::Tensor loss(const at::Tensor& inputs, const at::Tensor& targets, bool fused) override {
    return model_->loss(inputs, targets, fused);
  }

 private:
  std::string preset_;
  Bert model_;
  MaskingOptions masking_;
};

}  // namespace

std::unique_ptr<gpt2::Task> make_bert_task(std::string preset, const BertConfig& config,
                                           const MaskingOptions& masking, c10::Device device) {
  return std::make_unique<BertTask>(std::move(preset), config, masking, device);
}

}  // namespace bert

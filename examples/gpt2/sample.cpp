// The sample at the end of a run (--sample_tokens, --prompt, --top_k, --temperature).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "dtrain/fsdp.h"
#include "trainer.h"

namespace gpt2 {

// A short sample from rank 0, decoded with the tokenizer. Under FSDP the full weights are
// gathered first (a collective) into an unwrapped copy of the model. Only a GPT-2 generates
// text: for BERT every rank skips the sample alike.
void Trainer::generate_sample() {
  if (c_.sample_tokens == 0) return;
  Gpt sampler = task_->gpt();
  if (sampler.is_empty()) {
    say(fmt::format("sample: none: {} is a masked language model, which does not generate text",
                    c_.model));
    return;
  }
  if (auto* fsdp = dynamic_cast<dtrain::FullyShardedDataParallel*>(strategy_.get())) {
    auto full = fsdp->full_state_dict();
    if (!rank0()) return;
    sampler = Gpt(sampler->config());
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
    const size_t start = ids.size() > static_cast<size_t>(c_.context())
                             ? ids.size() - static_cast<size_t>(c_.context())
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

}  // namespace gpt2

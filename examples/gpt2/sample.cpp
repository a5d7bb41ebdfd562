// The sample at the end of a run (--sample_tokens, --prompt, --top_k, --temperature).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "dtrain/strategy.h"
#include "trainer.h"

namespace gpt2 {
namespace {

// Rank 0's `values` on every rank (its length first), over the communicator's device.
std::vector<int64_t> broadcast_ids(dtrain::Communicator& comm, std::vector<int64_t> values) {
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(comm.device());
  at::Tensor n = at::full({1}, static_cast<int64_t>(values.size()), on_device);
  comm.broadcast_sync(n, 0);
  const int64_t count = n.cpu().item<int64_t>();
  at::Tensor t = comm.rank() == 0
                     ? at::tensor(values, at::TensorOptions().dtype(at::kLong)).to(comm.device())
                     : at::empty({count}, on_device);
  if (count > 0) comm.broadcast_sync(t, 0);
  t = t.cpu();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + count);
}

}  // namespace

// A short sample, decoded with the tokenizer on rank 0. Under FSDP every rank runs each
// forward through the strategy, unit by unit as in training (no rank gathers the whole
// model); rank 0 picks each token and broadcasts it. Elsewhere rank 0 generates alone. Only
// a GPT-2 generates text: for BERT every rank skips the sample alike.
void Trainer::generate_sample() {
  if (c_.sample_tokens == 0) return;
  Gpt sampler = task_->gpt();
  if (sampler.is_empty()) {
    say(fmt::format("sample: none: {} is a masked language model, which does not generate text",
                    c_.model));
    return;
  }
  // Under FSDP the model runs only inside the strategy's forward, on every rank together.
  const bool fsdp = !strategy_->module_runs_outside_forward();
  const bool together = fsdp && comm_ && info_.world_size > 1;
  if (!together && !rank0()) return;
  c10::NoGradGuard no_grad;
  // Rank 0 encodes the prompt: whether a vocabulary exists (--data random needs none) may
  // differ between nodes, and rank 0's decides for every rank.
  std::vector<int64_t> ids;
  if (rank0() && tokenizer_) {
    for (int32_t id : tokenizer_->encode(c_.prompt)) ids.push_back(id);
    if (ids.empty()) ids.push_back(tokenizer_->eot() >= 0 ? tokenizer_->eot() : 0);
  }
  if (together) ids = broadcast_ids(*comm_, ids);
  if (ids.empty()) return;
  const size_t prompt_len = ids.size();
  at::manual_seed(static_cast<uint64_t>(c_.seed));
  const int64_t real_vocab = token_ids_;  // padded rows (--vocab) are never sampled
  for (int64_t i = 0; i < c_.sample_tokens; ++i) {
    const size_t start = ids.size() > static_cast<size_t>(c_.context())
                             ? ids.size() - static_cast<size_t>(c_.context())
                             : 0;
    std::vector<int64_t> window(ids.begin() + static_cast<std::ptrdiff_t>(start), ids.end());
    at::Tensor x =
        at::tensor(window, at::TensorOptions().dtype(at::kLong)).view({1, -1}).to(device_);
    auto last_logits = [&] { return sampler->forward(x).select(1, -1); };
    at::Tensor logits = fsdp ? strategy_->forward(last_logits) : last_logits();
    int64_t next = 0;
    if (rank0()) {
      logits = logits.to(at::kFloat).cpu().narrow(-1, 0, real_vocab);
      if (c_.top_k == 0) {
        next = logits.argmax(-1).item<int64_t>();
      } else {
        logits = logits / c_.temperature;
        auto top = logits.topk(std::min<int64_t>(c_.top_k, real_vocab), -1);
        at::Tensor probs = at::softmax(std::get<0>(top), -1);
        const int64_t choice = at::multinomial(probs, 1).item<int64_t>();
        next = std::get<1>(top).view({-1})[choice].item<int64_t>();
      }
    }
    if (together) next = broadcast_ids(*comm_, {next}).at(0);
    ids.push_back(next);
  }
  if (!rank0()) return;
  std::vector<int32_t> prompt_ids, sampled;
  for (size_t k = 0; k < ids.size(); ++k) {
    (k < prompt_len ? prompt_ids : sampled).push_back(static_cast<int32_t>(ids[k]));
  }
  const std::string prompt = tokenizer_->decode(prompt_ids);
  const std::string text = tokenizer_->decode(sampled);
  say(fmt::format("sample ({}): {}{}",
                  c_.top_k == 0 ? std::string("greedy")
                                : fmt::format("top-{}, temperature {}", c_.top_k, c_.temperature),
                  prompt, text));
}

}  // namespace gpt2

#include "hf_weights.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/errors.h"
#include "dtrain/safetensors.h"

namespace gpt2 {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Weights stored by Hugging Face's Conv1D: [in, out], the transpose of Linear's.
bool is_conv1d_weight(const std::string& name) {
  for (const char* t :
       {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    if (ends_with(name, t)) return true;
  }
  return false;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> to_hf_gpt2(
    const std::vector<std::pair<std::string, at::Tensor>>& ours) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, t] : ours) {
    at::Tensor v = t.detach().to(at::kFloat).cpu();
    out.emplace_back("transformer." + name, is_conv1d_weight(name) ? v.t().contiguous() : v);
  }
  return out;
}

void export_hf_safetensors(const std::string& path,
                           const std::vector<std::pair<std::string, at::Tensor>>& params) {
  dtrain::write_safetensors(path, to_hf_gpt2(params), {{"format", "pt"}});
}

void init_from_hf_safetensors(const std::string& path, Gpt& model) {
  dtrain::SafetensorsReader reader(path);
  c10::NoGradGuard no_grad;
  for (auto& item : model->named_parameters(true)) {
    const std::string& name = item.key();
    const dtrain::SafetensorsTensor* t = reader.find("transformer." + name);
    if (t == nullptr) t = reader.find(name);
    if (t == nullptr) {
      throw dtrain::CheckpointError(
          fmt::format("{}: no tensor transformer.{} (is it a GPT-2 checkpoint?)", path, name));
    }
    at::Tensor v = reader.read(t->name).to(at::kFloat);
    if (is_conv1d_weight(name)) v = v.t();
    if (v.sizes() != item.value().sizes()) {
      throw dtrain::CheckpointError(fmt::format(
          "{}: {} has shape [{}] but the model's {} needs [{}] (other --layers/--dim/--vocab?)",
          path, t->name, fmt::join(t->shape, ", "), name,
          fmt::join(item.value().sizes().vec(), ", ")));
    }
    item.value().copy_(v);
  }
}

}  // namespace gpt2

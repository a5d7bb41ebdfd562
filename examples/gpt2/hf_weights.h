// GPT-2 weights in Hugging Face's layout (transformers' GPT2LMHeadModel), as safetensors:
//
//   transformer.wte.weight [vocab, dim]        transformer.wpe.weight [ctx, dim]
//   transformer.h.N.ln_1.{weight,bias}         transformer.h.N.ln_2.{weight,bias}
//   transformer.h.N.attn.c_attn.{weight [dim, 3 dim], bias}
//   transformer.h.N.attn.c_proj.{weight [dim, dim], bias}
//   transformer.h.N.mlp.c_fc.{weight [dim, 4 dim], bias}
//   transformer.h.N.mlp.c_proj.{weight [4 dim, dim], bias}
//   transformer.ln_f.{weight,bias}
//
// Hugging Face's Conv1D stores [in, out] where torch's Linear stores [out, in], so those four
// weights are transposed. lm_head.weight is tied to wte and, as save_pretrained does, not
// written; header metadata {"format": "pt"} as transformers expects.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/strategy.h"
#include "model.h"

namespace gpt2 {

// Our parameter names and tensors -> Hugging Face's names and layouts (in the same order).
std::vector<std::pair<std::string, at::Tensor>> to_hf_gpt2(
    const std::vector<std::pair<std::string, at::Tensor>>& ours);

// Writes `params` (our names, full tensors) to `path` in Hugging Face's layout.
void export_hf_safetensors(const std::string& path,
                           const std::vector<std::pair<std::string, at::Tensor>>& params);

// Copies the weights of a Hugging Face GPT-2 safetensors file (names with or without the
// "transformer." prefix, as the hub's gpt2/model.safetensors has them) into `model`. Every
// parameter of the model must be there with its shape; lm_head.weight and attention-mask
// buffers in the file are ignored. Throws dtrain::CheckpointError naming the file and the
// tensor.
void init_from_hf_safetensors(const std::string& path, Gpt& model);

// What load_hf_safetensors read on this rank.
struct HfLoadStats {
  int64_t tensors = 0;     // parameters of which this rank holds elements
  int64_t elements = 0;    // elements written into this rank's parameters or shards
  int64_t bytes_read = 0;  // data bytes read from the file (SafetensorsReader::bytes_read)
};

// Streams a Hugging Face GPT-2 safetensors file into `strategy`'s parameters, after the
// strategy is built (with deferred initialisation under FSDP: no rank ever holds the whole
// model). Each rank reads, from the memory-mapped file, only the bytes of the elements its
// strategy.state_layout() holds: under FSDP its shards (a Conv1D weight, stored transposed,
// costs at most two of our rows more), under single-device or DDP every parameter. Same
// names, shapes and errors as init_from_hf_safetensors, checked on every rank before
// anything is written; then strategy.state_loaded(). Not collective.
HfLoadStats load_hf_safetensors(const std::string& path, dtrain::Strategy& strategy);

// Writes `strategy`'s parameters to `path` in Hugging Face's layout, the same bytes as the
// overload above given the full parameters, streamed: rank 0 writes the header, then
// receives and writes one tensor at a time (each element from exactly one rank: replicas
// split theirs), so no rank ever holds more than its state plus one whole tensor.
// Collective: every rank of the strategy calls it. Returns the tensor count on rank 0, 0
// elsewhere.
int64_t export_hf_safetensors(const std::string& path, dtrain::Strategy& strategy);

}  // namespace gpt2

// BERT as gpt2_train's task (--model bert-tiny | bert, docs/bert.md): the encoder
// (bert_model.h) trained as a masked language model on the sampler's sequences masked as
// BERT does (mlm_data.h); FSDP's units are LibTorch's stock TransformerEncoderLayers, found
// in their Sequential with no model edit. Compiled into gpt2_train, whose Task it implements.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "bert_model.h"
#include "mlm_data.h"
#include "task.h"

namespace bert {

// The task over a model built from `config` on `device` (from the current default
// generator), masking as `masking` says; `preset` names it in the log.
std::unique_ptr<gpt2::Task> make_bert_task(std::string preset, const BertConfig& config,
                                           const MaskingOptions& masking, c10::Device device);

}  // namespace bert

// All-gather with each rank's input quantised on the wire (FSDP's parameter gather under
// FsdpOptions::quantize_params, ZeRO++'s qwZ).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtrain/communicator.h"
#include "dtrain/quantization.h"
#include "dtrain/work.h"

namespace dtrain::detail {

// Like comm.all_gather(output, input): `output` (1-D, floating, world * input.numel()) gets
// every rank's input in rank order, each quantised by its rank and dequantised into output's
// dtype when the Work is waited for. Every rank gets the same values, its own slice included
// (quantised too, so that all ranks compute with the same parameters). Writes output through
// an alias with its own version counter (output's views keep theirs, as when a communicator
// writes into them). `wire_bytes`: this rank's quantised input.
WorkPtr quantized_all_gather(Communicator& comm, at::Tensor output, const at::Tensor& input,
                             Quantization q, int64_t block, int64_t* wire_bytes);

}  // namespace dtrain::detail

// StateLayout of strategies whose ranks all hold every parameter and buffer in full
// (SingleDevice, DataParallel): one replicated slice per tensor.
#pragma once

#include <string>
#include <vector>

#include "dtrain/strategy.h"

namespace torch::nn {
class Module;
}

namespace dtrain {

// Parameters (trainable ones stepped as themselves, frozen ones not stepped), then
// buffers, in module order. `comm` null means one rank.
StateLayout replicated_state_layout(torch::nn::Module& module, CommunicatorPtr comm,
                                    std::string sharding);

// For strategies that do not broadcast buffers every step (FSDP; DataParallel with
// broadcast_buffers off): a rank's buffers can differ from its peers' (BatchNorm statistics,
// updated from the rank's own rows), and the checkpoint's model entry holds rank 0's copy
// (checkpoint/layout.h, write_range). Adds each rank's own copy of every buffer slice to the
// layout's rank state ("buffer/<name>") and chains a loader that writes it back into the
// slice at a load of the same world size, after the model entries, so a resumed run goes on
// with every rank's own statistics. No-op for one rank.
void keep_rank_buffers(StateLayout& layout);

// The module's parameters as Strategy::named_parameters() lists them for a strategy that
// steps them as they are: module order, each with its own shape.
std::vector<NamedParameter> module_named_parameters(const torch::nn::Module& module);

// A 1-D alias of all of t's elements; throws InvalidArgument naming `name` if t is not
// contiguous (checkpoints write into it in place).
at::Tensor flat_alias(const at::Tensor& t, const std::string& name);

}  // namespace dtrain

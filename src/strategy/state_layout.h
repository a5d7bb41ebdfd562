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

// The module's parameters as Strategy::named_parameters() lists them for a strategy that
// steps them as they are: module order, each with its own shape.
std::vector<NamedParameter> module_named_parameters(const torch::nn::Module& module);

// A 1-D alias of all of t's elements; throws InvalidArgument naming `name` if t is not
// contiguous (checkpoints write into it in place).
at::Tensor flat_alias(const at::Tensor& t, const std::string& name);

}  // namespace dtrain

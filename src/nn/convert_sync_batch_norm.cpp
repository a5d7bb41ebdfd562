// convert_sync_batch_norm: BatchNorm entries of Sequentials become SyncBatchNorm. Entries are
// the only calls that can be redirected (a Sequential calls each entry through its
// AnyModule); a BatchNorm held anywhere else is refused before anything changes.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/errors.h"
#include "dtrain/sync_batch_norm.h"

namespace dtrain {
namespace {

using torch::nn::Module;

template <typename Impl>
const torch::nn::BatchNormOptions* options_if(const Module& m) {
  const auto* bn = dynamic_cast<const Impl*>(&m);
  return bn != nullptr ? &bn->options : nullptr;
}

// The options of a torch::nn::BatchNorm{1,2,3}d; null for any other module.
const torch::nn::BatchNormOptions* batch_norm_options(const Module& m) {
  if (const auto* o = options_if<torch::nn::BatchNorm1dImpl>(m)) return o;
  if (const auto* o = options_if<torch::nn::BatchNorm2dImpl>(m)) return o;
  return options_if<torch::nn::BatchNorm3dImpl>(m);
}

// A SyncBatchNorm holding copies of `bn`'s parameters and buffers (dtype, device and
// requires_grad included), in `bn`'s training mode.
std::shared_ptr<SyncBatchNormImpl> replacement(const Module& bn,
                                               const torch::nn::BatchNormOptions& options,
                                               const CommunicatorPtr& comm) {
  auto sync = std::make_shared<SyncBatchNormImpl>(options, comm);
  sync->train(bn.is_training());
  c10::NoGradGuard no_grad;
  // The same names exist on both: the options decide which (BatchNorm's registrations).
  auto copy = [](const torch::OrderedDict<std::string, at::Tensor>& from,
                 torch::OrderedDict<std::string, at::Tensor> to, const char* kind) {
    for (const auto& item : from) {
      at::Tensor* mine = to.find(item.key());
      if (mine == nullptr) {
        throw Error(
            fmt::format("convert_sync_batch_norm: internal error: SyncBatchNorm has no "
                        "{} '{}'",
                        kind, item.key()));
      }
      mine->set_data(item.value().detach().clone());
      mine->set_requires_grad(item.value().requires_grad());
    }
  };
  copy(bn.named_parameters(/*recurse=*/false), sync->named_parameters(/*recurse=*/false),
       "parameter");
  copy(bn.named_buffers(/*recurse=*/false), sync->named_buffers(/*recurse=*/false), "buffer");
  return sync;
}

struct Entry {
  std::shared_ptr<torch::nn::SequentialImpl> sequential;
  size_t index;     // entry position
  std::string key;  // its registered child name
  const Module* bn;
};

}  // namespace

std::shared_ptr<Module> convert_sync_batch_norm(std::shared_ptr<Module> module,
                                                CommunicatorPtr comm) {
  if (!module) throw InvalidArgument("convert_sync_batch_norm: module is null");
  if (!comm) throw InvalidArgument("convert_sync_batch_norm: communicator is null");
  const ErrorContext ctx{comm->rank(), comm->world_size(), "convert_sync_batch_norm", -1};
  if (const auto* options = batch_norm_options(*module)) {
    return replacement(*module, *options, comm);
  }

  // Every place a BatchNorm is registered: an entry of a Sequential, or somewhere no
  // converter can reach. A module shared by several parents is visited once per parent.
  std::vector<Entry> entries;
  std::vector<std::string> unreachable;
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    const std::shared_ptr<Module>& parent = item.value();
    auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(parent);
    for (const auto& child : parent->named_children()) {
      if (batch_norm_options(*child.value()) == nullptr) continue;
      const std::string path = item.key().empty() ? child.key() : item.key() + "." + child.key();
      bool found = false;
      if (sequential) {
        for (size_t i = 0; i < sequential->size(); ++i) {
          if (sequential->ptr(i).get() != child.value().get()) continue;
          entries.push_back(Entry{sequential, i, child.key(), child.value().get()});
          found = true;
        }
      }
      if (!found) unreachable.push_back(fmt::format("'{}' (in {})", path, parent->name()));
    }
  }
  if (!unreachable.empty()) {
    throw InvalidArgument(
        ctx, fmt::format("cannot replace BatchNorm {}: a C++ module calls such a child through "
                         "its own typed member, which a converter cannot redirect (only "
                         "torch::nn::Sequential entries can be replaced); construct it as "
                         "dtrain::SyncBatchNorm instead. Nothing was converted",
                         fmt::join(unreachable, ", ")));
  }

  // One replacement per BatchNorm, however many entries hold it.
  std::map<const Module*, std::shared_ptr<SyncBatchNormImpl>> made;
  for (const Entry& e : entries) {
    if (made.count(e.bn) == 0) {
      made.emplace(e.bn, replacement(*e.bn, *batch_norm_options(*e.bn), comm));
    }
  }
  for (const Entry& e : entries) {
    const std::shared_ptr<SyncBatchNormImpl>& sync = made.at(e.bn);
    *(e.sequential->begin() + static_cast<std::ptrdiff_t>(e.index)) = torch::nn::AnyModule(sync);
    e.sequential->replace_module(e.key, sync);
  }
  return module;
}

}  // namespace dtrain

// FSDP units that need no model edit: entries of a torch::nn::Sequential.
//
// A Sequential runs its entries through type-erased torch::nn::AnyModule values
// (SequentialImpl::forward calls each entry's any_forward), and its non-const iterator lets
// an entry be replaced in place. SequentialUnits replaces the entry of every unit module with
// a UnitEntry whose forward runs the original entry through unit_call, and puts the original
// entries back when it is destroyed. The Sequential's registered children are untouched, so
// named_parameters(), state dicts and the module tree keep their names ("layers.3.linear1.
// weight"), and `seq[i]` / `seq->ptr(i)` still return the stock module (UnitEntry's holder
// answers ptr() with the original module). Only `seq->at<T>(i)` sees the replacement while
// FSDP is alive (it throws "Attempted to cast module of type UnitEntry ...").
//
// ModuleList and ModuleDict are not covered: models reach their entries through
// `->as<T>()`, a dynamic_cast to the concrete type followed by a call bound at compile time
// to T::forward; a replaced entry would make as<T>() return null, and there is nothing to
// intercept. Those calls need dtrain::unit_call (see dtrain/fsdp.h).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <set>
#include <vector>

namespace dtrain::fsdp {

class Schedule;

// Stands in for a unit's entry in a Sequential. Sequential::forward passes it the entry's
// arguments (any number up to kMaxArguments, any types, default arguments of the original
// still applied by the original) and gets back what the original returns.
class UnitEntry final : public torch::nn::Module {
 public:
  static constexpr size_t kMaxArguments = 8;

  // `owner`: the schedule whose unit the entry is; its forward outside the owner's forward
  // (and backward, which recomputes checkpointed units) throws InvalidArgument instead of
  // computing with sharded parameters. Null: no check (a clone, whose module is no unit).
  explicit UnitEntry(torch::nn::AnyModule original, const Schedule* owner = nullptr);

  torch::nn::AnyValue forward(std::vector<torch::nn::AnyValue> arguments);

  const torch::nn::AnyModule& original() const { return original_; }

 private:
  torch::nn::AnyValue call_original(std::vector<torch::nn::AnyValue>&& arguments);

  torch::nn::AnyModule original_;
  const Schedule* owner_;
};

class SequentialUnits {
 public:
  // Replaces, in every Sequential under `root` (root included), each entry whose module is
  // one of `units` (units of `owner`).
  SequentialUnits(const std::shared_ptr<torch::nn::Module>& root,
                  const std::set<const torch::nn::Module*>& units, const Schedule* owner);
  ~SequentialUnits();  // restores the original entries
  SequentialUnits(const SequentialUnits&) = delete;
  SequentialUnits& operator=(const SequentialUnits&) = delete;

 private:
  struct Replaced {
    std::shared_ptr<torch::nn::SequentialImpl> sequential;
    size_t index;
    torch::nn::AnyModule original;
  };
  std::vector<Replaced> replaced_;
};

}  // namespace dtrain::fsdp

namespace torch::nn {

// How AnyModule holds a UnitEntry (what `AnyModule(std::shared_ptr<UnitEntry>)` instantiates):
// all arguments reach UnitEntry::forward as one vector, whatever their number, and ptr()
// is the original module, so the Sequential looks unchanged from outside.
template <>
struct AnyModuleHolder<dtrain::fsdp::UnitEntry, std::vector<AnyValue>> : AnyModulePlaceholder {
  explicit AnyModuleHolder(std::shared_ptr<dtrain::fsdp::UnitEntry>&& entry)
      : AnyModulePlaceholder(typeid(dtrain::fsdp::UnitEntry)), module(std::move(entry)) {}

  AnyValue forward(std::vector<AnyValue>&& arguments) override {
    return module->forward(std::move(arguments));
  }
  std::shared_ptr<Module> ptr() override { return module->original().ptr(); }
  std::unique_ptr<AnyModulePlaceholder> copy() const override {
    return std::make_unique<AnyModuleHolder>(*this);
  }
  // A clone (Sequential::clone) wraps the original entry's clone, whose module is no FSDP's
  // unit: its calls are plain.
  std::unique_ptr<AnyModulePlaceholder> clone_module(optional<Device> device) const override;

  std::shared_ptr<dtrain::fsdp::UnitEntry> module;
};

}  // namespace torch::nn

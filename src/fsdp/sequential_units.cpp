#include "fsdp/sequential_units.h"

#include <array>
#include <string>
#include <utility>

#include <c10/util/Type.h>
#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "fsdp/active.h"
#include "fsdp/schedule.h"

namespace dtrain {

// A Sequential entry's result, known to be a tensor (UnitEntry::forward checks it first).
template <>
struct UnitOutput<torch::nn::AnyValue> {
  template <typename F>
  static void for_each_tensor(const torch::nn::AnyValue& value, F&& f) {
    f(*const_cast<torch::nn::AnyValue&>(value).try_get<at::Tensor>());
  }
};

namespace fsdp {
namespace {

using torch::nn::AnyModule;
using torch::nn::AnyValue;
using Arguments = std::vector<AnyValue>;

// AnyModule::any_forward takes its arguments as a pack; a call with N arguments from a vector
// is one instantiation per N, picked from a table. AnyValue arguments pass through unwrapped.
template <size_t... I>
AnyValue call_unpacked(AnyModule& m, Arguments& a, std::index_sequence<I...>) {
  (void)a;  // unused when N is 0
  return m.any_forward(std::move(a[I])...);
}

template <size_t N>
AnyValue call_with(AnyModule& m, Arguments& a) {
  return call_unpacked(m, a, std::make_index_sequence<N>{});
}

template <size_t... N>
constexpr auto call_table(std::index_sequence<N...>) {
  return std::array<AnyValue (*)(AnyModule&, Arguments&), sizeof...(N)>{&call_with<N>...};
}

constexpr auto kCallTable = call_table(std::make_index_sequence<UnitEntry::kMaxArguments + 1>{});

}  // namespace

UnitEntry::UnitEntry(AnyModule original, const Schedule* owner)
    : original_(std::move(original)), owner_(owner) {}

AnyValue UnitEntry::call_original(Arguments&& arguments) {
  if (arguments.size() > kMaxArguments) {
    throw InvalidArgument(fmt::format(
        "FSDP unit {} in a torch::nn::Sequential was called with {} arguments; FSDP forwards "
        "at most {}",
        original_.ptr()->name(), arguments.size(), kMaxArguments));
  }
  return kCallTable[arguments.size()](original_, arguments);
}

AnyValue UnitEntry::forward(Arguments arguments) {
  torch::nn::Module& module = *original_.ptr();
  // Backward (ARMED) runs a checkpointed unit again, gathered, outside the forward.
  if (owner_ != nullptr && active_schedule() != owner_ &&
      owner_->phase() != Schedule::Phase::kArmed) {
    const int index = owner_->unit_of(module);
    throw InvalidArgument(forward_outside_message(
        module, index >= 0 ? owner_->unit(static_cast<size_t>(index)).name() : ""));
  }
  return unit_call(module, [&] {
    AnyValue out = call_original(std::move(arguments));
    if (out.try_get<at::Tensor>() == nullptr) {
      // Only a tensor can be found in a type-erased result; anything else would run the
      // unit's backward without its parameters gathered.
      throw InvalidArgument(fmt::format(
          "FSDP unit {} in a torch::nn::Sequential returned {}, not a tensor: FSDP can hook "
          "only at::Tensor results of Sequential entries; call this module through "
          "dtrain::unit_call (with a dtrain::UnitOutput for its result type)",
          module.name(), c10::demangle(out.type_info().name())));
    }
    return out;
  });
}

SequentialUnits::SequentialUnits(const std::shared_ptr<torch::nn::Module>& root,
                                 const std::set<const torch::nn::Module*>& units,
                                 const Schedule* owner) {
  for (const auto& item : root->named_modules("", /*include_self=*/true)) {
    auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(item.value());
    if (!sequential) continue;
    size_t index = 0;
    for (auto it = sequential->begin(); it != sequential->end(); ++it, ++index) {
      if (units.count(it->ptr().get()) == 0) continue;
      replaced_.push_back(Replaced{sequential, index, *it});
      *it = AnyModule(std::make_shared<UnitEntry>(*it, owner));
    }
  }
}

SequentialUnits::~SequentialUnits() {
  for (auto r = replaced_.rbegin(); r != replaced_.rend(); ++r) {
    *(r->sequential->begin() + static_cast<std::ptrdiff_t>(r->index)) = std::move(r->original);
  }
}

}  // namespace fsdp
}  // namespace dtrain

namespace torch::nn {

std::unique_ptr<AnyModulePlaceholder> AnyModuleHolder<
    dtrain::fsdp::UnitEntry, std::vector<AnyValue>>::clone_module(optional<Device> device) const {
  return std::make_unique<AnyModuleHolder>(
      std::make_shared<dtrain::fsdp::UnitEntry>(module->original().clone(device)));
}

}  // namespace torch::nn

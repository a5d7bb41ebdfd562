// FSDP on models that were not written for it: stock torch::nn::TransformerEncoderLayers in a
// torch::nn::Sequential become units with no model edit, and unit_call accepts any return
// type (tuples, user structs). Each must train exactly as single-device training does.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "compat/autograd_errors.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/single_device.h"
#include "strategy/inspect.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using testing::run_ranks;

constexpr int kSteps = 3;
constexpr int64_t kLocalBatch = 2, kT = 6, kVocab = 20, kDim = 16;

// An encoder whose code knows nothing of FSDP: stock layers run by Sequential::forward, the
// first one also given an attention mask (two arguments, so FSDP's stand-in entry must pass
// any number of arguments through).
struct EncoderImpl : torch::nn::Module {
  EncoderImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    layers = register_module("layers", torch::nn::Sequential());
    for (int i = 0; i < 3; ++i) {
      layers->push_back(torch::nn::TransformerEncoderLayer(
          torch::nn::TransformerEncoderLayerOptions(kDim, 2).dim_feedforward(32).dropout(0.0)));
    }
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  at::Tensor forward(const at::Tensor& idx) {
    // Position t attends to positions <= t: a mask that changes the result.
    at::Tensor mask = at::full({kT, kT}, -1e9).triu(1);
    at::Tensor x = layers->forward(embed->forward(idx).transpose(0, 1), mask);
    return head->forward(x.transpose(0, 1));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Sequential layers{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Encoder);

struct Data {
  std::vector<at::Tensor> x, y;
};

Data make_data(int world) {
  at::manual_seed(99);
  Data d;
  for (int s = 0; s < kSteps; ++s) {
    d.x.push_back(at::randint(kVocab, {kLocalBatch * world, kT}, at::kLong));
    d.y.push_back(at::randint(kVocab, {kLocalBatch * world, kT}, at::kLong));
  }
  return d;
}

// Trains `module` under `strategy` on rows [row0, row0 + rows) of each step's batch.
template <typename Loss>
void train(Strategy& strategy, const Data& d, int64_t row0, int64_t rows, const Loss& loss_of) {
  torch::optim::SGD opt(strategy.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    at::Tensor x = d.x[s].narrow(0, row0, rows), y = d.y[s].narrow(0, row0, rows);
    at::Tensor l = strategy.forward([&] { return loss_of(x, y); });
    strategy.backward(l);
    opt.step();
  }
}

void expect_matches(const std::vector<std::pair<std::string, at::Tensor>>& state,
                    const torch::nn::Module& ref) {
  auto want = ref.named_parameters();
  DTRAIN_CHECK(state.size() == want.size(), "full state dict has {} entries, the model {}",
               state.size(), want.size());
  for (const auto& [name, t] : state) {
    DTRAIN_CHECK(want.contains(name), "full state dict has '{}', the model does not", name);
    DTRAIN_CHECK(at::allclose(t, want[name], 1e-5, 1e-6),
                 "parameter {} differs from single-device training: max |diff| {}", name,
                 (t - want[name]).abs().max().item<double>());
  }
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& y) {
  return at::cross_entropy_loss(logits.reshape({-1, kVocab}), y.reshape({-1}));
}

// The reference: `ref` trained on one device over every step's whole batch.
template <typename Model>
void train_single_device(Model& ref, const Data& d, int world) {
  SingleDevice single(ref.ptr());
  train(single, d, 0, kLocalBatch * world,
        [&](const at::Tensor& x, const at::Tensor& y) { return lm_loss(ref->forward(x), y); });
}

// One model per rank, each built after seeding with seed_of(rank).
template <typename Model, typename SeedOf, typename... Args>
std::vector<Model> models_per_rank(int world, const SeedOf& seed_of, const Args&... args) {
  std::vector<Model> models;
  for (int r = 0; r < world; ++r) {
    at::manual_seed(seed_of(r));
    models.emplace_back(args...);
  }
  return models;
}

struct SequentialCase {
  std::string name;
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  bool forward_prefetch = false;
  int world = 2;
};
void PrintTo(const SequentialCase& c, std::ostream* os) { *os << c.name; }

class FsdpSequential : public ::testing::TestWithParam<SequentialCase> {};

// The stock layers are units although the model never calls unit_call: they are gathered,
// freed and reduce-scattered one by one, and training matches single-device training.
TEST_P(FsdpSequential, StockEncoderLayersAreUnitsAndMatchSingleDevice) {
  const SequentialCase c = GetParam();
  at::set_num_threads(1);
  const Data d = make_data(c.world);
  at::manual_seed(7);
  Encoder ref;
  train_single_device(ref, d, c.world);
  // FSDP broadcasts rank 0's weights.
  auto models = models_per_rank<Encoder>(c.world, [](int r) { return r == 0 ? 7 : 100 + r; });
  run_ranks(c.world, [&](Communicator& comm) {
    const int r = comm.rank();
    Encoder& m = models[r];
    std::vector<std::string> names;
    for (const auto& item : m->named_parameters()) names.push_back(item.key());
    FsdpOptions o;
    o.sharding = c.sharding;
    o.forward_prefetch = c.forward_prefetch;
    o.wrap_policy = wrap_modules_named("TransformerEncoderLayer");
    {
      FullyShardedDataParallel fsdp(m.ptr(), std::shared_ptr<Communicator>(&comm, [](auto*) {}), o);
      // The Sequential looks unchanged: same parameter names, its entries the stock layers.
      std::vector<std::string> now;
      for (const auto& item : m->named_parameters()) now.push_back(item.key());
      DTRAIN_CHECK(now == names, "parameter names changed under FSDP");
      for (size_t i = 0; i < m->layers->size(); ++i) {
        DTRAIN_CHECK(m->layers[i]->as<torch::nn::TransformerEncoderLayer>() != nullptr,
                     "layers[{}] is not the stock layer under FSDP", i);
      }
      train(fsdp, d, r * kLocalBatch, kLocalBatch,
            [&](const at::Tensor& x, const at::Tensor& y) { return lm_loss(m->forward(x), y); });
      const auto order = detail::Inspect::unit_order(fsdp);
      DTRAIN_CHECK((order == std::vector<std::string>{"layers.0", "layers.1", "layers.2"}),
                   "unit order {}", fmt::join(order, ", "));
      if (c.sharding == ShardingStrategy::kFullShard && c.world > 1) {
        const auto log = detail::Inspect::last_collective_log(fsdp);
        // A prefetched gather is logged as "all_gather:layers.1 (prefetch)".
        for (const std::string entry : {"all_gather:layers.1", "reduce_scatter:layers.1"}) {
          const bool found = std::any_of(log.begin(), log.end(), [&](const std::string& e) {
            return e == entry || e == entry + " (prefetch)";
          });
          DTRAIN_CHECK(found, "{} not in {}", entry, fmt::join(log, ", "));
        }
      }
      auto state = fsdp.full_state_dict();
      if (r == 0) expect_matches(state, *ref);
    }
    // Once FSDP is gone the Sequential holds its original entries again.
    DTRAIN_CHECK(m->layers->ptr<torch::nn::TransformerEncoderLayerImpl>(0) != nullptr,
                 "layers[0] not restored");
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FsdpSequential,
    ::testing::Values(SequentialCase{"full_shard_world2"},
                      SequentialCase{"full_shard_world3", ShardingStrategy::kFullShard, false, 3},
                      SequentialCase{"full_shard_forward_prefetch", ShardingStrategy::kFullShard,
                                     true},
                      SequentialCase{"shard_grad_op", ShardingStrategy::kShardGradOp},
                      SequentialCase{"no_shard", ShardingStrategy::kNoShard}),
    [](const auto& info) { return info.param.name; });

// A unit that returns two tensors. The model uses the second one last, so its gradient
// reaches the unit first: the unit must be gathered then, from a hook on that output.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    a = register_module("a", torch::nn::Linear(kDim, kDim));
    b = register_module("b", torch::nn::Linear(kDim, kDim));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    return {at::tanh(a->forward(x)), at::tanh(b->forward(x))};
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoHeads);

// A user struct of tensors, made visible to unit_call by a UnitOutput specialization.
struct Pair {
  at::Tensor first, second;
  int64_t calls = 0;  // not a tensor: skipped
};

}  // namespace

template <>
struct UnitOutput<Pair> {
  template <typename F>
  static void for_each_tensor(const Pair& p, F&& f) {
    f(p.first);
    f(p.second);
  }
};

namespace {

struct TupleModelImpl : torch::nn::Module {
  explicit TupleModelImpl(bool as_struct) : as_struct(as_struct) {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    unit = register_module("unit", TwoHeads());
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor x = embed->forward(idx);
    at::Tensor first, second;
    if (as_struct) {
      Pair p = unit_call(*unit, [&] {
        auto [f, s] = unit->forward(x);
        return Pair{f, s, 1};
      });
      first = p.first, second = p.second;
    } else {
      std::tie(first, second) = unit_call(*unit, [&] { return unit->forward(x); });
    }
    // `second` feeds the newest part of the graph, so backward reaches it first.
    at::Tensor small = first.pow(2).mean();
    return head->forward(second) + small;
  }
  bool as_struct;
  torch::nn::Embedding embed{nullptr};
  TwoHeads unit{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TupleModel);

void expect_unit_with_two_outputs_matches_single(bool as_struct) {
  at::set_num_threads(1);
  const int world = 2;
  const Data d = make_data(world);
  at::manual_seed(11);
  TupleModel ref(as_struct);
  train_single_device(ref, d, world);
  auto models = models_per_rank<TupleModel>(
      world, [](int) { return 11; }, as_struct);
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    FsdpOptions o;
    o.wrap_policy = [](const std::string& name, const torch::nn::Module&) {
      return name == "unit";
    };
    o.backward_prefetch = BackwardPrefetch::kNone;  // the unit's gather comes from its own hook
    FullyShardedDataParallel fsdp(models[r].ptr(),
                                  std::shared_ptr<Communicator>(&comm, [](auto*) {}), o);
    train(fsdp, d, r * kLocalBatch, kLocalBatch, [&](const at::Tensor& x, const at::Tensor& y) {
      return lm_loss(models[r]->forward(x), y);
    });
    auto state = fsdp.full_state_dict();
    if (r == 0) expect_matches(state, *ref);
  });
}

TEST(FsdpUnitCall, TupleOutputGetsCorrectGradients) {
  expect_unit_with_two_outputs_matches_single(/*as_struct=*/false);
}

TEST(FsdpUnitCall, StructOutputWithUnitOutputGetsCorrectGradients) {
  expect_unit_with_two_outputs_matches_single(/*as_struct=*/true);
}

// --- ParamsInBackward ---

// A table (a unit) looked up first, a linear unit, then a second use of the table: another
// lookup, or a matmul with it (whose backward reads it); each call declares what its backward
// reads.
enum class SecondUse { kLookup, kMatmul };
struct TiedCase {
  std::string name;
  ParamsInBackward first = ParamsInBackward::kNotRead;
  SecondUse second = SecondUse::kLookup;
  ParamsInBackward second_reads = ParamsInBackward::kNotRead;
  BackwardPrefetch prefetch = BackwardPrefetch::kBackwardPre;
  bool keep_between_calls = true;  // FsdpOptions::keep_gathered_between_calls
};
void PrintTo(const TiedCase& c, std::ostream* os) { *os << c.name; }

// A row lookup whose backward needs only the indices. (LibTorch 1.13's at::embedding saves the
// weight itself, for its row count, so its backward counts as reading it.)
struct Lookup : torch::autograd::Function<Lookup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& table,
                            const at::Tensor& idx) {
    ctx->save_for_backward({idx});
    ctx->saved_data["rows"] = table.size(0);
    return table.index_select(0, idx.reshape({-1})).view({idx.size(0), idx.size(1), table.size(1)});
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const at::Tensor idx = ctx->get_saved_variables()[0];
    const at::Tensor g = grad[0].reshape({-1, grad[0].size(-1)});
    at::Tensor table_grad = at::zeros({ctx->saved_data["rows"].toInt(), g.size(1)}, g.options());
    return {table_grad.index_add_(0, idx.reshape({-1}), g), at::Tensor()};
  }
};

struct TiedTableImpl : torch::nn::Module {
  explicit TiedTableImpl(TiedCase c) : c(std::move(c)) {
    table = register_module("table", torch::nn::Embedding(kVocab, kDim));
    fc = register_module("fc", torch::nn::Linear(kDim, kDim));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor x = unit_call(
        *table, [&] { return Lookup::apply(table->weight, idx); }, c.first);
    at::Tensor h = at::tanh(unit_call(*fc, [&] { return fc->forward(x); }));
    if (c.second == SecondUse::kLookup) {
      at::Tensor other = (idx * 7 + 3).remainder(kVocab);
      at::Tensor g = unit_call(
          *table, [&] { return Lookup::apply(table->weight, other); }, c.second_reads);
      return head->forward(h * g);
    }
    at::Tensor tied = unit_call(
        *table, [&] { return at::linear(h, table->weight); }, c.second_reads);
    return head->forward(h) + tied;
  }
  TiedCase c;
  torch::nn::Embedding table{nullptr};
  torch::nn::Linear fc{nullptr}, head{nullptr};
};
TORCH_MODULE(TiedTable);

FsdpOptions tied_options(const TiedCase& c) {
  FsdpOptions o;
  o.wrap_policy = [](const std::string& name, const torch::nn::Module&) {
    return name == "table" || name == "fc";
  };
  o.backward_prefetch = c.prefetch;
  o.keep_gathered_between_calls = c.keep_between_calls;
  return o;
}

class FsdpParamsInBackward : public ::testing::TestWithParam<TiedCase> {};

// Calls declared kNotRead leave the table sharded from their end to the next forward (it is
// gathered in forward only: once, kept between its calls, or once per call); training
// matches single-device.
TEST_P(FsdpParamsInBackward, UnreadTableStaysShardedAndTrainingMatchesSingleDevice) {
  const TiedCase c = GetParam();
  at::set_num_threads(1);
  const int world = 2;
  const Data d = make_data(world);
  at::manual_seed(12);
  TiedTable ref(c);
  train_single_device(ref, d, world);
  auto models = models_per_rank<TiedTable>(
      world, [](int) { return 12; }, c);
  const bool read_in_backward = c.second_reads == ParamsInBackward::kRead;
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    FullyShardedDataParallel fsdp(
        models[r].ptr(), std::shared_ptr<Communicator>(&comm, [](auto*) {}), tied_options(c));
    size_t released_after_forward = 0;
    train(fsdp, d, r * kLocalBatch, kLocalBatch, [&](const at::Tensor& x, const at::Tensor& y) {
      at::Tensor loss = lm_loss(models[r]->forward(x), y);
      released_after_forward += models[r]->table->weight.storage().nbytes() == 0;
      return loss;
    });
    const auto log = detail::Inspect::last_collective_log(fsdp);
    const auto gathers = std::count(log.begin(), log.end(), "all_gather:table") +
                         std::count(log.begin(), log.end(), "all_gather:table (prefetch)");
    const long in_forward = c.keep_between_calls ? 1 : 2;
    DTRAIN_CHECK(gathers == in_forward + (read_in_backward ? 1 : 0),
                 "table gathered {} times in a step: {}", gathers,
                 fmt::format("{}", fmt::join(log, ", ")));
    if (!read_in_backward) {
      DTRAIN_CHECK(released_after_forward == static_cast<size_t>(kSteps),
                   "the table was gathered at the end of {} of {} forwards",
                   kSteps - static_cast<int>(released_after_forward), kSteps);
    }
    auto state = fsdp.full_state_dict();
    if (r == 0) expect_matches(state, *ref);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FsdpParamsInBackward,
    ::testing::Values(TiedCase{"two_lookups"},
                      TiedCase{"two_lookups_freed_between_calls", ParamsInBackward::kNotRead,
                               SecondUse::kLookup, ParamsInBackward::kNotRead,
                               BackwardPrefetch::kBackwardPre, false},
                      TiedCase{"two_lookups_prefetch_post", ParamsInBackward::kNotRead,
                               SecondUse::kLookup, ParamsInBackward::kNotRead,
                               BackwardPrefetch::kBackwardPost},
                      TiedCase{"lookup_then_matmul_read", ParamsInBackward::kNotRead,
                               SecondUse::kMatmul, ParamsInBackward::kRead}),
    [](const auto& info) { return info.param.name; });

// A matmul declared kNotRead: its backward would read the freed table. Every rank's backward
// throws InvalidArgument naming the declaration, instead of computing with freed memory.
TEST(FsdpParamsInBackwardErrors, ASavedParameterOfAnUnreadCallIsAnError) {
  at::set_num_threads(1);
  const TiedCase c{"matmul_declared_unread", ParamsInBackward::kNotRead, SecondUse::kMatmul,
                   ParamsInBackward::kNotRead};
  const int world = 2;
  const Data d = make_data(world);
  std::vector<TiedTable> models;
  for (int r = 0; r < world; ++r) models.emplace_back(c);
  std::vector<std::string> errors(world);
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    FullyShardedDataParallel fsdp(
        models[r].ptr(), std::shared_ptr<Communicator>(&comm, [](auto*) {}), tied_options(c));
    at::Tensor x = d.x[0].narrow(0, r * kLocalBatch, kLocalBatch);
    at::Tensor y = d.y[0].narrow(0, r * kLocalBatch, kLocalBatch);
    at::Tensor l = fsdp.forward([&] { return lm_loss(models[r]->forward(x), y); });
    try {
      fsdp.backward(l);
    } catch (const Error& e) {  // the first step: FSDP is unusable after it, as the error says
      errors[r] = e.what();
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(errors[r].find("ParamsInBackward::kNotRead"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// The explanation above hangs on LibTorch's text (compat/autograd_errors.h, the one place it
// is read): make LibTorch raise the error, so a release that rewords it fails here.
TEST(LibTorchSavedTensorError, IsRecognisedAndOtherErrorsAreNot) {
  at::Tensor x = at::ones({3}).requires_grad_();
  at::Tensor a = x * 2;
  at::Tensor b = a * a;  // saves a for backward
  a.mul_(3);             // bumps a's version
  try {
    b.sum().backward();
    ADD_FAILURE() << "backward did not fail";
  } catch (const c10::Error& e) {
    EXPECT_TRUE(compat::is_saved_tensor_modified(e)) << e.what_without_backtrace();
  }
  try {
    (void)at::ones({2, 3}).matmul(at::ones({2, 3}));
    ADD_FAILURE() << "matmul did not fail";
  } catch (const c10::Error& e) {
    EXPECT_FALSE(compat::is_saved_tensor_modified(e)) << e.what_without_backtrace();
  }
}

// kNotRead after a kRead call of the same unit would invalidate the first call's saved
// parameters: refused in forward.
TEST(FsdpParamsInBackwardErrors, UnreadAfterReadInOneForwardIsRefused) {
  at::set_num_threads(1);
  const TiedCase c{"read_then_unread", ParamsInBackward::kRead, SecondUse::kLookup,
                   ParamsInBackward::kNotRead};
  std::vector<std::string> errors(2);
  std::vector<TiedTable> models{TiedTable(c), TiedTable(c)};
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    FullyShardedDataParallel fsdp(
        models[r].ptr(), std::shared_ptr<Communicator>(&comm, [](auto*) {}), tied_options(c));
    try {
      fsdp.forward([&] { return models[r]->forward(at::zeros({1, kT}, at::kLong)).sum(); });
    } catch (const InvalidArgument& e) {
      errors[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("kNotRead after a call with kRead"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// unit_call passes any return type through unchanged outside FSDP.
TEST(FsdpUnitCall, PlainCallOutsideFsdp) {
  torch::nn::Linear l(2, 2);
  auto t =
      unit_call(*l, [&] { return std::make_tuple(at::ones({1}), 3, std::vector<at::Tensor>{}); });
  EXPECT_EQ(std::get<1>(t), 3);
  EXPECT_EQ(std::get<0>(t).item<float>(), 1.0f);
}

}  // namespace
}  // namespace dtrain

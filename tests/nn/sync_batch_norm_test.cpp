// SyncBatchNorm against LibTorch's BatchNorm{1,2,3}d on the global batch: N ranks (threads,
// Gloo over loopback) each normalize their rows, possibly of different counts or none, and
// must get the reference's rows of the output and of the input's gradient, the reference's
// weight and bias gradients summed over ranks, and its running statistics; evaluation mode,
// the errors, and the converter.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "dtrain/errors.h"
#include "dtrain/sync_batch_norm.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

CommunicatorPtr borrowed(Communicator& comm) {
  return CommunicatorPtr(&comm, [](Communicator*) {});
}

CommunicatorOptions short_timeout() {
  CommunicatorOptions o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

struct BnCase {
  std::string name;
  int dims = 4;  // input dims: 2 or 3 (BatchNorm1d), 4 (2d), 5 (3d)
  bool affine = true;
  bool track = true;
  c10::optional<double> momentum = 0.1;
  std::vector<int64_t> rows = {2, 5, 3};  // rows of rank r (the first world_size entries)
  c10::ScalarType dtype = at::kDouble;
  // float64: only the order of summation differs from the reference.
  double rtol = 1e-9, atol = 1e-10;
};
void PrintTo(const BnCase& c, std::ostream* os) { *os << c.name; }

// Module::to(dtype) would cast num_batches_tracked too: floating-point tensors only.
void to_dtype(torch::nn::Module& m, c10::ScalarType dtype) {
  for (auto& t : m.parameters()) t.set_data(t.detach().to(dtype));
  for (auto& t : m.buffers()) {
    if (t.is_floating_point()) t.set_data(t.to(dtype));
  }
}

torch::nn::AnyModule reference_bn(int dims, const torch::nn::BatchNormOptions& o) {
  if (dims <= 3) return torch::nn::AnyModule(torch::nn::BatchNorm1d(o));
  if (dims == 4) return torch::nn::AnyModule(torch::nn::BatchNorm2d(o));
  return torch::nn::AnyModule(torch::nn::BatchNorm3d(o));
}

std::vector<int64_t> shape_of(int dims, int64_t rows, int64_t channels) {
  std::vector<int64_t> s{rows, channels};
  const int64_t spatial[] = {3, 2, 2};
  for (int d = 2; d < dims; ++d) s.push_back(spatial[d - 2]);
  return s;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol, double atol,
                  const std::string& what, int rank) {
  DTRAIN_CHECK(got.sizes() == want.sizes(), "rank {} {}: shape", rank, what);
  DTRAIN_CHECK(got.scalar_type() == want.scalar_type(), "rank {} {}: dtype", rank, what);
  DTRAIN_CHECK(at::allclose(got.to(at::kDouble), want.to(at::kDouble), rtol, atol),
               "rank {} {} differs from BatchNorm on the global batch: max |diff| {}", rank, what,
               got.numel() == 0
                   ? 0.0
                   : (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>());
}

class SyncBatchNormRanks : public ::testing::TestWithParam<std::tuple<int, BnCase>> {};

TEST_P(SyncBatchNormRanks, MatchesBatchNormOnTheGlobalBatch) {
  const int world = std::get<0>(GetParam());
  const BnCase c = std::get<1>(GetParam());
  at::set_num_threads(1);
  constexpr int64_t kChannels = 4;
  constexpr int kSteps = 3;
  const auto options =
      torch::nn::BatchNormOptions(kChannels).affine(c.affine).track_running_stats(c.track).momentum(
          c.momentum);
  std::vector<int64_t> rows(c.rows.begin(), c.rows.begin() + world);
  std::vector<int64_t> row0(static_cast<size_t>(world), 0);
  for (int r = 1; r < world; ++r) row0[r] = row0[r - 1] + rows[r - 1];
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});

  // The reference: LibTorch's BatchNorm on the whole batch, from non-trivial parameters and
  // statistics, for kSteps training steps with loss sum(y * probe), then evaluation.
  torch::manual_seed(29);
  torch::nn::AnyModule ref = reference_bn(c.dims, options);
  to_dtype(*ref.ptr(), c.dtype);
  {
    at::NoGradGuard no_grad;
    for (auto& p : ref.ptr()->parameters()) p.copy_(at::randn(p.sizes(), p.options()));
    if (c.track) {
      auto buffers = ref.ptr()->named_buffers();
      buffers["running_mean"].copy_(at::randn({kChannels}));
      buffers["running_var"].copy_(at::rand({kChannels}) + 0.5);
      buffers["num_batches_tracked"].fill_(2);
    }
  }
  const auto initial_params = ref.ptr()->named_parameters();
  const auto initial_buffers = ref.ptr()->named_buffers();
  std::vector<std::pair<std::string, at::Tensor>> start;
  for (const auto& item : initial_params)
    start.emplace_back(item.key(), item.value().detach().clone());
  for (const auto& item : initial_buffers) start.emplace_back(item.key(), item.value().clone());

  struct Step {
    at::Tensor x, probe, y, x_grad;
    std::vector<at::Tensor> param_grads;
    std::vector<at::Tensor> buffers;
  };
  std::vector<Step> steps;
  const auto opts = at::TensorOptions().dtype(c.dtype);
  for (int s = 0; s < kSteps; ++s) {
    Step st;
    // An offset mean, so that a variance computed from raw sums of squares would show.
    st.x = at::randn(shape_of(c.dims, total, kChannels), opts) * 2 + 3;
    st.probe = at::randn(shape_of(c.dims, total, kChannels), opts);
    at::Tensor x = st.x.clone().requires_grad_();
    for (auto& p : ref.ptr()->parameters()) p.mutable_grad().reset();
    st.y = ref.forward(x);
    (st.y * st.probe).sum().backward();
    st.x_grad = x.grad();
    for (auto& p : ref.ptr()->parameters()) st.param_grads.push_back(p.grad().clone());
    for (auto& b : ref.ptr()->buffers()) st.buffers.push_back(b.clone());
    steps.push_back(st);
  }
  const at::Tensor eval_x = at::randn(shape_of(c.dims, total, kChannels), opts) + 1;
  ref.ptr()->eval();
  at::Tensor eval_y;
  std::vector<at::Tensor> eval_rows;  // without running statistics: each rank's own batch
  {
    at::NoGradGuard no_grad;
    eval_y = ref.forward(eval_x);
    for (int r = 0; r < world; ++r)
      eval_rows.push_back(ref.forward(eval_x.narrow(0, row0[r], rows[r])));
  }

  run_ranks(
      world,
      [&](Communicator& comm) {
        const int r = comm.rank();
        SyncBatchNorm bn(options, borrowed(comm));
        to_dtype(*bn, c.dtype);
        {
          at::NoGradGuard no_grad;
          auto params = bn->named_parameters();
          auto buffers = bn->named_buffers();
          for (const auto& [name, value] : start) {
            at::Tensor* t = params.find(name);
            if (t == nullptr) t = buffers.find(name);
            DTRAIN_CHECK(t != nullptr, "no {} in SyncBatchNorm", name);
            t->copy_(value);
          }
          DTRAIN_CHECK(params.size() + buffers.size() == start.size(), "tensor count");
        }
        for (int s = 0; s < kSteps; ++s) {
          const Step& st = steps[s];
          at::Tensor x = st.x.narrow(0, row0[r], rows[r]).clone().requires_grad_();
          for (auto& p : bn->parameters()) p.mutable_grad().reset();
          at::Tensor y = bn->forward(x);
          (y * st.probe.narrow(0, row0[r], rows[r])).sum().backward();
          const std::string at_step = " at step " + std::to_string(s);
          expect_close(y, st.y.narrow(0, row0[r], rows[r]), c.rtol, c.atol, "output" + at_step, r);
          expect_close(x.grad(), st.x_grad.narrow(0, row0[r], rows[r]), c.rtol, c.atol,
                       "input gradient" + at_step, r);
          // weight and bias get this rank's part: the ranks' parts sum to the reference's.
          const auto params = bn->parameters();
          DTRAIN_CHECK(params.size() == st.param_grads.size(), "parameter count");
          for (size_t i = 0; i < params.size(); ++i) {
            at::Tensor g = params[i].grad().clone();
            comm.all_reduce(g, ReduceOp::kSum)->wait();
            expect_close(g, st.param_grads[i], c.rtol, c.atol,
                         "summed gradient of parameter #" + std::to_string(i) + at_step, r);
          }
          const auto buffers = bn->buffers();
          DTRAIN_CHECK(buffers.size() == st.buffers.size(), "buffer count");
          for (size_t i = 0; i < buffers.size(); ++i) {
            expect_close(buffers[i], st.buffers[i], c.rtol, c.atol,
                         "buffer #" + std::to_string(i) + at_step, r);
          }
        }
        bn->eval();
        const uint64_t issued = comm.sequence_number();
        at::NoGradGuard no_grad;
        at::Tensor y = bn->forward(eval_x.narrow(0, row0[r], rows[r]));
        expect_close(y, c.track ? eval_y.narrow(0, row0[r], rows[r]) : eval_rows[r], c.rtol, c.atol,
                     "evaluation output", r);
        DTRAIN_CHECK(comm.sequence_number() == issued, "evaluation issued a collective");
      },
      short_timeout());
}

std::vector<BnCase> bn_cases() {
  auto make = [](std::string name, const std::function<void(BnCase&)>& set) {
    BnCase c;
    c.name = std::move(name);
    set(c);
    return c;
  };
  return {
      make("bn2d", [](BnCase&) {}),
      make("bn1d_2d_input", [](BnCase& c) { c.dims = 2; }),
      make("bn1d_3d_input", [](BnCase& c) { c.dims = 3; }),
      make("bn3d", [](BnCase& c) { c.dims = 5; }),
      make("no_affine", [](BnCase& c) { c.affine = false; }),
      make("no_running_stats", [](BnCase& c) { c.track = false; }),
      make("cumulative_average", [](BnCase& c) { c.momentum = c10::nullopt; }),
      // A rank with no rows still takes part in both exchanges.
      make("empty_rank",
           [](BnCase& c) {
             c.rows = {3, 0, 2};
           }),
      // Ranks with a single row (no variance of their own) of BatchNorm1d's [N, C].
      make("one_row_ranks",
           [](BnCase& c) {
             c.dims = 2;
             c.rows = {2, 1, 1};
           }),
      // fp32: the reference's kernel sums in another order (float round-off, not a formula).
      make("float32",
           [](BnCase& c) {
             c.dtype = at::kFloat;
             c.rtol = 1e-4;
             c.atol = 1e-5;
           }),
  };
}

INSTANTIATE_TEST_SUITE_P(Ranks, SyncBatchNormRanks,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::ValuesIn(bn_cases())),
                         [](const auto& info) {
                           return std::get<1>(info.param).name + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument)";
}

TEST(SyncBatchNorm, RefusesBadInputOnTheCallingRank) {
  run_ranks(
      2,
      [](Communicator& comm) {
        SyncBatchNorm bn(torch::nn::BatchNormOptions(3), borrowed(comm));
        const std::string channels = error_of([&] { bn->forward(at::randn({4, 5, 2})); });
        DTRAIN_CHECK(channels.find("expected a floating-point input of shape [N, 3, *], got "
                                   "Float [4, 5, 2]") != std::string::npos,
                     "{}", channels);
        DTRAIN_CHECK(channels.find("SyncBatchNorm") != std::string::npos, "{}", channels);
        const std::string one_dim = error_of([&] { bn->forward(at::randn({3})); });
        DTRAIN_CHECK(one_dim.find("got Float [3]") != std::string::npos, "{}", one_dim);
        const std::string integer = error_of([&] { bn->forward(at::ones({4, 3}, at::kLong)); });
        DTRAIN_CHECK(integer.find("got Long [4, 3]") != std::string::npos, "{}", integer);
        // Nothing was exchanged: the ranks can go on.
        DTRAIN_CHECK(comm.sequence_number() == 0, "a refused input issued a collective");
      },
      short_timeout());
  EXPECT_THROW(SyncBatchNorm(torch::nn::BatchNormOptions(3), nullptr), InvalidArgument);
}

TEST(SyncBatchNorm, OneValuePerChannelOverAllRanksFailsOnEveryRank) {
  // Rank 0 has one row, rank 1 none: one value per channel in the global batch.
  run_ranks(
      2,
      [](Communicator& comm) {
        SyncBatchNorm bn(torch::nn::BatchNormOptions(3), borrowed(comm));
        const std::string e = error_of([&] {
          bn->forward(at::randn({comm.rank() == 0 ? 1 : 0, 3}));
        });
        DTRAIN_CHECK(e.find("expected more than 1 value per channel when training, got 1 over "
                            "all ranks") != std::string::npos,
                     "rank {}: {}", comm.rank(), e);
        // Both ranks reached the same verdict after the same exchange: the next one matches.
        at::Tensor y = bn->forward(at::randn({2, 3}));
        DTRAIN_CHECK(y.sizes() == at::IntArrayRef({2, 3}), "shape");
      },
      short_timeout());
}

// --- convert_sync_batch_norm ---

struct TypedMemberImpl : torch::nn::Module {
  TypedMemberImpl()
      : body(register_module(
            "body", torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4)))),
        bn(register_module("bn", torch::nn::BatchNorm1d(4))) {}
  at::Tensor forward(const at::Tensor& x) { return bn->forward(body->forward(x)); }
  torch::nn::Sequential body;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(TypedMember);

std::shared_ptr<SyncBatchNormImpl> as_sync(const std::shared_ptr<torch::nn::Module>& m) {
  return std::dynamic_pointer_cast<SyncBatchNormImpl>(m);
}

// A Sequential nested in a module that calls it (entries convert at any depth).
struct WrapperImpl : torch::nn::Module {
  explicit WrapperImpl(torch::nn::Sequential s) : inner(register_module("inner", std::move(s))) {}
  at::Tensor forward(const at::Tensor& x) { return inner->forward(x); }
  torch::nn::Sequential inner;
};
TORCH_MODULE(Wrapper);

// Evaluation with a bf16 input and bf16 weight next to fp32 statistics (what FSDP's
// param_dtype bf16 made of them before it kept norm parameters in fp32): computed in fp32 and
// cast back, as training does, instead of ATen's "expected scalar type BFloat16 but found
// Float".
TEST(SyncBatchNorm, EvaluationHandlesMixedDtypesLikeTraining) {
  run_ranks(1, [](Communicator& comm) {
    torch::manual_seed(3);
    SyncBatchNorm bn(torch::nn::BatchNormOptions(4), borrowed(comm));
    {
      at::NoGradGuard no_grad;
      bn->weight.uniform_(0.5, 1.5);
      bn->bias.uniform_(-0.5, 0.5);
      bn->running_mean.uniform_(-1, 1);
      bn->running_var.uniform_(0.5, 2);
    }
    const at::Tensor x = at::randn({3, 4, 5}).to(at::kBFloat16);
    const at::Tensor want =
        at::batch_norm(x.to(at::kFloat), bn->weight.to(at::kBFloat16).to(at::kFloat),
                       bn->bias.to(at::kBFloat16).to(at::kFloat), bn->running_mean, bn->running_var,
                       false, 0.0, 1e-5, false)
            .to(at::kBFloat16);
    for (auto* p : {&bn->weight, &bn->bias}) p->set_data(p->detach().to(at::kBFloat16));
    bn->eval();
    const at::Tensor got = bn->forward(x);
    DTRAIN_CHECK(got.scalar_type() == at::kBFloat16, "output {}", c10::toString(got.scalar_type()));
    DTRAIN_CHECK(at::equal(got, want), "max |diff| {}",
                 (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>());
    // fp32 parameters and statistics with a bf16 input (FSDP's norm parameters now): the same.
    for (auto* p : {&bn->weight, &bn->bias}) p->set_data(p->detach().to(at::kFloat));
    const at::Tensor again = bn->forward(x);
    DTRAIN_CHECK(at::equal(again, want), "fp32 parameters: max |diff| {}",
                 (again.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>());
  });
}

TEST(ConvertSyncBatchNorm, ReplacesSequentialEntriesWithTheirState) {
  run_ranks(1, [](Communicator& comm) {
    torch::manual_seed(3);
    auto shared = torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(6).momentum(0.3));
    torch::nn::Sequential inner(
        torch::nn::Linear(6, 6), shared,
        torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(6).affine(false)));
    torch::nn::Sequential model(
        torch::nn::Linear(5, 6), shared, torch::nn::Tanh(), Wrapper(inner),
        torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(6).track_running_stats(false)));
    {
      at::NoGradGuard no_grad;
      for (auto& b : model->buffers()) {
        if (b.is_floating_point()) b.copy_(at::rand(b.sizes()) + 0.5);
      }
      for (auto& p : model->parameters()) p.copy_(at::randn(p.sizes()));
      shared->num_batches_tracked.fill_(7);
    }
    shared->bias.set_requires_grad(false);  // a frozen parameter stays frozen
    model->eval();
    const at::Tensor x = at::randn({8, 5});
    at::Tensor before;
    {
      at::NoGradGuard no_grad;
      before = model->forward(x);
    }
    const auto params = model->named_parameters();
    const auto buffers = model->named_buffers();
    std::map<std::string, at::Tensor> old_values;
    for (const auto& item : params) old_values[item.key()] = item.value().detach().clone();
    for (const auto& item : buffers) old_values[item.key()] = item.value().clone();

    auto converted = convert_sync_batch_norm(model.ptr(), borrowed(comm));
    DTRAIN_CHECK(converted.get() == model.ptr().get(), "the root is kept");
    DTRAIN_CHECK(as_sync(model->ptr(1)) != nullptr, "entry 1 converted");
    DTRAIN_CHECK(as_sync(model->ptr(4)) != nullptr, "entry 4 converted");
    DTRAIN_CHECK(as_sync(inner->ptr(1)) != nullptr && as_sync(inner->ptr(2)) != nullptr,
                 "nested entries converted");
    DTRAIN_CHECK(model->ptr(1).get() == inner->ptr(1).get(), "a shared BatchNorm stays shared");
    DTRAIN_CHECK(as_sync(model->named_children()["1"]) != nullptr, "registered child replaced");
    DTRAIN_CHECK(as_sync(model->ptr(1))->options.momentum() == 0.3, "options copied");
    DTRAIN_CHECK(shared->num_batches_tracked.item<int64_t>() == 7, "the original is untouched");

    const auto new_params = model->named_parameters();
    const auto new_buffers = model->named_buffers();
    DTRAIN_CHECK(new_params.keys() == params.keys(), "parameter names {} vs {}",
                 fmt::join(new_params.keys(), ","), fmt::join(params.keys(), ","));
    DTRAIN_CHECK(new_buffers.keys() == buffers.keys(), "buffer names");
    for (const auto& item : new_params) {
      DTRAIN_CHECK(at::equal(item.value(), old_values[item.key()]), "{} copied", item.key());
      DTRAIN_CHECK(item.value().requires_grad() == params[item.key()].requires_grad(),
                   "{}: requires_grad", item.key());
      const bool linear = item.key().rfind("0.", 0) == 0 || item.key().rfind("3.inner.0.", 0) == 0;
      DTRAIN_CHECK(linear || !item.value().is_same(params[item.key()]), "{}: a new tensor",
                   item.key());
    }
    for (const auto& item : new_buffers) {
      DTRAIN_CHECK(at::equal(item.value(), old_values[item.key()]), "{} copied", item.key());
      DTRAIN_CHECK(item.value().scalar_type() == buffers[item.key()].scalar_type(), "{} dtype",
                   item.key());
    }
    // The Sequential now calls the replacements: in evaluation they compute what BatchNorm did.
    at::NoGradGuard no_grad;
    DTRAIN_CHECK(at::allclose(model->forward(x), before, 1e-6, 1e-6), "evaluation output");
  });
}

TEST(ConvertSyncBatchNorm, RefusesTypedMembersAndChangesNothing) {
  run_ranks(1, [](Communicator& comm) {
    TypedMember model;
    const std::string e = error_of([&] { convert_sync_batch_norm(model.ptr(), borrowed(comm)); });
    DTRAIN_CHECK(e.find("cannot replace BatchNorm 'bn' (in ") != std::string::npos &&
                     e.find("TypedMemberImpl") != std::string::npos &&
                     e.find("construct it as dtrain::SyncBatchNorm") != std::string::npos,
                 "{}", e);
    DTRAIN_CHECK(e.find("'body.1'") == std::string::npos, "a Sequential entry is convertible: {}",
                 e);
    DTRAIN_CHECK(as_sync(model->body->ptr(1)) == nullptr, "the Sequential was changed: {}", e);
  });
}

TEST(ConvertSyncBatchNorm, ARootBatchNormIsReturnedConverted) {
  run_ranks(1, [](Communicator& comm) {
    auto bn = torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(3).eps(1e-3));
    auto converted = as_sync(convert_sync_batch_norm(bn.ptr(), borrowed(comm)));
    DTRAIN_CHECK(converted != nullptr, "not converted");
    DTRAIN_CHECK(converted->options.eps() == 1e-3, "options");
    DTRAIN_CHECK(converted->communicator().get() == &comm, "communicator");
  });
  EXPECT_THROW(convert_sync_batch_norm(nullptr, nullptr), InvalidArgument);
}

}  // namespace
}  // namespace dtrain

// FSDP's parts without a communicator: the flat parameter (layout, shards, views, release and
// refill, gradient flattening), the unit's state machine (every transition checks where it
// starts from) and the schedule's phase (likewise).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/store.h"
#include "fsdp/flat_param.h"
#include "fsdp/schedule.h"
#include "fsdp/unit.h"

namespace dtrain::fsdp {
namespace {

// Leaf parameters of 6, 4 and 3 elements (13 in all) with distinct values.
std::vector<at::Tensor> make_params() {
  std::vector<at::Tensor> p = {at::arange(6, at::kFloat).view({2, 3}),
                               at::arange(10, 14, at::kFloat), at::arange(20, 23, at::kFloat)};
  for (auto& t : p) t.requires_grad_(true);
  return p;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

const std::vector<std::string> kNames = {"a", "b", "c"};

TEST(FsdpFlatParam, LayoutPadsToTheShardGroupAndShardsHoldTheirSlice) {
  const auto want = copies(make_params());
  const at::Tensor flat = at::cat({want[0].reshape({-1}), want[1], want[2], at::zeros({3})});
  for (int rank = 0; rank < 4; ++rank) {
    FlatParam f(make_params(), kNames, FlatParamOptions{4, rank, at::kFloat});
    EXPECT_EQ(f.numel(), 13);
    EXPECT_EQ(f.padded(), 16);
    EXPECT_EQ(f.shard_numel(), 4);
    EXPECT_EQ(f.shard_begin(), 4 * rank);
    EXPECT_EQ(f.offset(0), 0);
    EXPECT_EQ(f.offset(1), 6);
    EXPECT_EQ(f.offset(2), 10);
    EXPECT_FALSE(f.shares_memory());
    EXPECT_TRUE(f.shard().is_leaf());
    EXPECT_TRUE(f.shard().requires_grad());
    EXPECT_TRUE(at::equal(f.shard().detach(), flat.narrow(0, 4 * rank, 4))) << "rank " << rank;
    // Each parameter is a view of full with its old shape and values.
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(f.param(i).sizes(), want[i].sizes());
      EXPECT_TRUE(at::equal(f.param(i).detach(), want[i])) << kNames[i];
      EXPECT_EQ(f.param(i).storage().unsafeGetStorageImpl(),
                f.full().storage().unsafeGetStorageImpl())
          << kNames[i];
    }
  }
}

TEST(FsdpFlatParam, ShardRangesCoverEveryParameterExactlyOnce) {
  // 13 elements over 3 ranks: shards of 5; a (elements 0..5) straddles ranks 0 and 1, b (6..9)
  // is inside rank 1's, c (10..12) inside rank 2's with the padding.
  std::vector<std::vector<int64_t>> seen(3);
  for (int rank = 0; rank < 3; ++rank) {
    FlatParam f(make_params(), kNames, FlatParamOptions{3, rank, at::kFloat});
    ASSERT_EQ(f.padded(), 15);
    for (size_t i = 0; i < 3; ++i) {
      const auto r = f.shard_range(i);
      ASSERT_LE(r.begin, r.end);
      for (int64_t e = r.begin; e < r.end; ++e) {
        seen[i].push_back(e);
        // The element sits where the shard says it does.
        EXPECT_EQ(f.shard()[r.shard_offset + (e - r.begin)].item<float>(),
                  f.param(i).detach().reshape({-1})[e].item<float>())
            << kNames[i] << " element " << e << " rank " << rank;
      }
    }
  }
  const std::vector<int64_t> sizes = {6, 4, 3};
  for (size_t i = 0; i < 3; ++i) {
    std::sort(seen[i].begin(), seen[i].end());
    ASSERT_EQ(static_cast<int64_t>(seen[i].size()), sizes[i]) << kNames[i];
    for (int64_t e = 0; e < sizes[i]; ++e) EXPECT_EQ(seen[i][e], e) << kNames[i];
  }
}

// FsdpOptions::use_orig_params: each parameter's part of the shard is a leaf of its own on
// the shard's memory, and its .grad is the shard gradient's matching part after every
// add_to_shard_grad(), whatever zero_grad() did in between.
TEST(FsdpFlatParam, ShardViewsShareTheShardAndTheirGradientsItsGradient) {
  // Rank 1 of 3 holds flat elements [5, 10): a's last element and all of b, none of c.
  FlatParam f(make_params(), kNames, FlatParamOptions{3, 1, at::kFloat, /*param_views=*/true});
  const at::Tensor& shard = f.shard();
  const std::vector<int64_t> sizes = {1, 4, 0}, offsets = {0, 1, 0};
  for (size_t i = 0; i < 3; ++i) {
    const at::Tensor& v = f.shard_view(i);
    EXPECT_TRUE(v.is_leaf() && v.requires_grad()) << kNames[i];
    EXPECT_EQ(v.dim(), 1);
    EXPECT_EQ(v.numel(), sizes[i]) << kNames[i];
    EXPECT_TRUE(v.is_same(f.shard_view(i))) << "the same tensor every call";
    if (sizes[i] > 0) {
      EXPECT_EQ(v.data_ptr<float>(), shard.data_ptr<float>() + offsets[i]) << kNames[i];
    }
  }
  auto grads_share_the_shard_gradient = [&] {
    for (size_t i = 0; i < 2; ++i) {
      const at::Tensor& g = f.shard_view(i).grad();
      if (!g.defined() || g.data_ptr<float>() != shard.grad().data_ptr<float>() + offsets[i]) {
        return false;
      }
    }
    return f.shard_view(2).grad().defined() && f.shard_view(2).grad().numel() == 0;
  };
  f.add_to_shard_grad(at::arange(5, at::kFloat));
  EXPECT_TRUE(at::equal(shard.grad(), at::arange(5, at::kFloat)));
  EXPECT_TRUE(grads_share_the_shard_gradient()) << "first step";
  EXPECT_TRUE(at::equal(f.shard_view(1).grad(), at::arange(1, 5, at::kFloat)));

  // LibTorch 1.13's zero_grad(): detach_() and zero_() in place, which autograd allows only
  // on tensors that are not views.
  for (size_t i = 0; i < 3; ++i) {
    at::Tensor& g = f.shard_view(i).mutable_grad();
    g.detach_();
    g.zero_();
  }
  f.add_to_shard_grad(at::ones({5}));
  EXPECT_TRUE(at::equal(shard.grad(), at::ones({5})));
  EXPECT_TRUE(grads_share_the_shard_gradient()) << "after zeroing in place";

  // LibTorch 2.x's zero_grad() resets .grad to undefined; here b's only: a keeps its 1.
  f.shard_view(1).mutable_grad().reset();
  f.add_to_shard_grad(at::full({5}, 10.0));
  EXPECT_TRUE(at::equal(shard.grad(), at::tensor({11.0f, 10.0f, 10.0f, 10.0f, 10.0f})));
  EXPECT_TRUE(grads_share_the_shard_gradient()) << "after a reset";

  // An optimizer's update of a view is the shard's.
  const at::Tensor before = shard.detach().clone();
  {
    c10::NoGradGuard no_grad;
    f.shard_view(1).sub_(f.shard_view(1).grad());
  }
  EXPECT_TRUE(at::equal(shard.detach(), before - at::tensor({0.0f, 10.0f, 10.0f, 10.0f, 10.0f})));

  f.zero_shard_grad();
  EXPECT_EQ(shard.grad().abs().sum().item<float>(), 0.0f);
  EXPECT_TRUE(grads_share_the_shard_gradient());

  FlatParam flat(make_params(), kNames, FlatParamOptions{3, 1, at::kFloat});
  EXPECT_THROW(flat.shard_view(0), InvalidArgument);
}

// A shard gradient no view uses any more (the trainer resets .grad to undefined, as 2.x's
// zero_grad() does) is dropped when the next step begins instead of living through it.
TEST(FsdpFlatParam, AShardGradientNoViewSharesIsReleased) {
  FlatParam f(make_params(), kNames, FlatParamOptions{3, 1, at::kFloat, /*param_views=*/true});
  f.add_to_shard_grad(at::arange(5, at::kFloat));
  f.release_unshared_shard_grad();
  ASSERT_TRUE(f.shard().grad().defined()) << "every view still shares it";

  f.shard_view(1).mutable_grad().reset();  // a's part (one element) still shares it
  f.release_unshared_shard_grad();
  ASSERT_TRUE(f.shard().grad().defined()) << "a's gradient still shares it";
  EXPECT_EQ(f.shard_view(0).grad().item<float>(), 0.0f);

  // Every view reset; c's empty view keeps an empty alias, which holds no gradient.
  f.shard_view(0).mutable_grad().reset();
  ASSERT_EQ(f.shard_view(2).numel(), 0);
  f.release_unshared_shard_grad();
  EXPECT_FALSE(f.shard().grad().defined());
  // The next reduction starts from zero, as for ordinary parameters after a reset.
  f.add_to_shard_grad(at::full({5}, 2.0));
  EXPECT_TRUE(at::equal(f.shard().grad(), at::full({5}, 2.0)));
  EXPECT_TRUE(at::equal(f.shard_view(1).grad(), at::full({4}, 2.0)));

  // Without views the shard gradient is what the optimizer steps: never dropped here.
  FlatParam flat(make_params(), kNames, FlatParamOptions{3, 1, at::kFloat});
  flat.add_to_shard_grad(at::ones({5}));
  flat.release_unshared_shard_grad();
  EXPECT_TRUE(flat.shard().grad().defined());
}

TEST(FsdpFlatParam, ReleasedMemoryComesBackUnderTheSameStorage) {
  const auto want = copies(make_params());
  std::vector<FlatParam> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back(make_params(), kNames, FlatParamOptions{2, rank, at::kFloat});
  }
  FlatParam& f = ranks[0];
  c10::StorageImpl* storage = f.full().storage().unsafeGetStorageImpl();
  f.release();
  EXPECT_TRUE(f.released());
  EXPECT_EQ(f.full().storage().nbytes(), 0u);
  EXPECT_EQ(f.param(1).storage().nbytes(), 0u) << "the parameter views share the released storage";
  f.refill();
  EXPECT_FALSE(f.released());
  EXPECT_EQ(f.full().storage().unsafeGetStorageImpl(), storage);
  EXPECT_EQ(f.full().storage().nbytes(), static_cast<size_t>(f.padded()) * sizeof(float));
  // What an all-gather does: every rank's gather_input at its place in full.
  {
    c10::NoGradGuard no_grad;
    for (int rank = 0; rank < 2; ++rank) {
      f.full().narrow(0, rank * f.shard_numel(), f.shard_numel()).copy_(ranks[rank].gather_input());
    }
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::equal(f.param(i).detach(), want[i])) << kNames[i];
  }
}

TEST(FsdpFlatParam, OneShardKeepsItsMemoryAndFp32SharesIt) {
  FlatParam f(make_params(), kNames, FlatParamOptions{1, 0, at::kFloat});
  EXPECT_TRUE(f.shares_memory());
  EXPECT_EQ(f.shard().data_ptr(), f.full().data_ptr());
  f.release();
  EXPECT_FALSE(f.released()) << "one shard keeps the memory";
  // The optimizer's update of the shard is the module's parameter.
  {
    c10::NoGradGuard no_grad;
    f.shard().add_(1.0);
  }
  EXPECT_EQ(f.param(2).detach()[0].item<float>(), 21.0f);

  FlatParam b(make_params(), kNames, FlatParamOptions{1, 0, at::kBFloat16});
  EXPECT_FALSE(b.shares_memory());
  EXPECT_EQ(b.full().scalar_type(), at::kBFloat16);
  EXPECT_EQ(b.param(0).scalar_type(), at::kBFloat16);
  EXPECT_EQ(b.shard().scalar_type(), at::kFloat);
  {
    c10::NoGradGuard no_grad;
    b.shard().add_(1.0);
  }
  b.copy_shard_to_full();
  EXPECT_EQ(b.param(2).detach()[2].item<float>(), 23.0f);
}

TEST(FsdpFlatParam, TakeGradsFlattensPadsAndClears) {
  FlatParam f(make_params(), kNames, FlatParamOptions{4, 1, at::kFloat});
  f.param(0).mutable_grad() = at::full({2, 3}, 1.0);
  f.param(2).mutable_grad() = at::full({3}, 3.0);  // b got no gradient
  at::Tensor flat = f.take_grads(at::kBFloat16);
  EXPECT_EQ(flat.scalar_type(), at::kBFloat16);
  ASSERT_EQ(flat.numel(), 16);
  const at::Tensor want =
      at::cat({at::full({6}, 1.0), at::zeros({4}), at::full({3}, 3.0), at::zeros({3})});
  EXPECT_TRUE(at::equal(flat.to(at::kFloat), want));
  for (size_t i = 0; i < 3; ++i) EXPECT_FALSE(f.param(i).grad().defined()) << kNames[i];
}

TEST(FsdpFlatParam, TakeGradsOfOneUnpaddedParameterTakesItsGradientWithoutACopy) {
  // 12 elements over 4 ranks: no padding.
  FlatParam f({at::zeros({3, 4}, at::kFloat).requires_grad_(true)}, {"w"},
              FlatParamOptions{4, 0, at::kFloat});
  f.param(0).mutable_grad() = at::arange(12, at::kFloat).reshape({3, 4}).clone();
  const void* memory = f.param(0).grad().data_ptr();
  at::Tensor flat = f.take_grads(at::kFloat);
  EXPECT_EQ(flat.data_ptr(), memory);
  EXPECT_TRUE(at::equal(flat, at::arange(12, at::kFloat)));
  EXPECT_FALSE(f.param(0).grad().defined());

  // Referenced elsewhere too (the autograd engine holds it while the gradient hook runs):
  // taken all the same (a reduction only reads it).
  at::Tensor kept = at::arange(12, at::kFloat).view({3, 4});
  f.param(0).mutable_grad() = kept;
  flat = f.take_grads(at::kFloat);
  EXPECT_EQ(flat.data_ptr(), kept.data_ptr());
  EXPECT_FALSE(f.param(0).grad().defined());

  // In another dtype or not contiguous: copied.
  f.param(0).mutable_grad() = at::arange(12, at::kFloat).view({3, 4});
  flat = f.take_grads(at::kBFloat16);
  EXPECT_EQ(flat.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(flat.to(at::kFloat), at::arange(12, at::kFloat)));
  f.param(0).mutable_grad() = at::arange(12, at::kFloat).view({4, 3}).t();
  flat = f.take_grads(at::kFloat);
  EXPECT_TRUE(at::equal(flat, at::arange(12, at::kFloat).view({4, 3}).t().reshape({-1})));
  EXPECT_FALSE(f.param(0).grad().defined());
}

// Records what a unit reports.
struct Recorder : UnitObserver {
  std::vector<std::string> entries;
  int failures = 0;
  int issued_count = 0;
  void issued(Collective, int, int64_t) override { ++issued_count; }
  void record(std::string entry) override { entries.push_back(std::move(entry)); }
  void waited(std::chrono::steady_clock::duration) override {}
  void failed() noexcept override { ++failures; }
};

void expect_internal_error(const std::function<void()>& fn, const std::string& message) {
  try {
    fn();
    ADD_FAILURE() << "expected: " << message;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

// ReshardAfterForward::kHost's state: the host piece comes back into full exactly, and the
// transitions around SHARDED_POST_FORWARD check where they start from.
TEST(FsdpUnit, ShardedPostForwardGathersTheHostPieceBack) {
  UnitComms comms;  // one rank per host: the piece is the whole unit, gathered by a copy
  Recorder rec;
  Unit u(1, "h0", FlatParam(make_params(), kNames, FlatParamOptions{1, 0, at::kBFloat16}), &comms,
         &rec);
  const at::Tensor before = u.flat().full().clone();
  u.reshard_to_host();
  EXPECT_EQ(u.param_state(), Unit::ParamState::kShardedPostForward);
  expect_internal_error([&] { u.reshard(); },
                        "unit 'h0' is SHARDED_POST_FORWARD, reshard needs UNSHARDED");
  expect_internal_error([&] { u.reshard_to_host(); },
                        "is SHARDED_POST_FORWARD, reshard_to_host needs UNSHARDED");
  u.flat().full().detach().zero_();  // what comes back must come from the piece
  u.ensure_unsharded();
  EXPECT_EQ(u.param_state(), Unit::ParamState::kUnsharded);
  EXPECT_TRUE(at::equal(u.flat().full(), before));
  EXPECT_EQ(rec.entries, std::vector<std::string>{"all_gather_host:h0"});
  u.reshard_to_host();
  u.reshard_any();  // drops the piece
  EXPECT_EQ(u.param_state(), Unit::ParamState::kSharded);
  EXPECT_EQ(rec.failures, 2);
}

TEST(FsdpUnit, TransitionsCheckWhereTheyStartFrom) {
  UnitComms comms;  // no groups: gathering is a local copy
  Recorder rec;
  Unit u(1, "h0", FlatParam(make_params(), kNames, FlatParamOptions{1, 0, at::kBFloat16}), &comms,
         &rec);
  EXPECT_EQ(u.param_state(), Unit::ParamState::kUnsharded);
  EXPECT_EQ(u.grad_state(), Unit::GradState::kIdle);
  expect_internal_error([&] { u.unshard(""); },
                        "internal error: unit 'h0' is UNSHARDED, unshard needs SHARDED");
  u.reshard();
  EXPECT_EQ(u.param_state(), Unit::ParamState::kSharded);
  expect_internal_error([&] { u.wait_unsharded(); },
                        "unit 'h0' is SHARDED, wait_unsharded needs GATHERING");
  expect_internal_error([&] { u.reshard(); }, "unit 'h0' is SHARDED, reshard needs UNSHARDED");
  u.unshard(" (prefetch)");
  EXPECT_EQ(u.param_state(), Unit::ParamState::kUnsharded) << "no shard group: no gather";
  EXPECT_EQ(rec.entries, std::vector<std::string>{"all_gather:h0 (prefetch)"});
  EXPECT_EQ(rec.issued_count, 0) << "a local copy is not a collective";

  expect_internal_error([&] { u.launch_reduction(); },
                        "unit 'h0' gradient is IDLE, launch_reduction needs ACCUMULATING");
  expect_internal_error([&] { u.gradient_arrived(); },
                        "gradient is IDLE, gradient arrival needs ACCUMULATING");
  expect_internal_error([&] { u.accumulate(); }, "gradient is IDLE, accumulate needs REDUCED");
  EXPECT_EQ(rec.failures, 6) << "every refused transition marks the step failed";
}

TEST(FsdpUnit, AGradientCycleEndsInTheShardsGradient) {
  UnitComms comms;
  Recorder rec;
  Unit u(0, "(root)", FlatParam(make_params(), kNames, FlatParamOptions{}), &comms, &rec);
  for (int step = 1; step <= 2; ++step) {
    u.arm();
    EXPECT_EQ(u.pending(), 3);
    u.flat().param(0).mutable_grad() = at::full({2, 3}, 1.0);
    u.flat().param(1).mutable_grad() = at::full({4}, 2.0);
    u.flat().param(2).mutable_grad() = at::full({3}, 3.0);
    EXPECT_FALSE(u.gradient_arrived());
    EXPECT_FALSE(u.gradient_arrived());
    EXPECT_TRUE(u.gradient_arrived()) << "the last parameter completes the unit";
    expect_internal_error([&] { u.complete_reduction(); },
                          "gradient is ACCUMULATING, complete_reduction needs REDUCING");
    u.launch_reduction();
    EXPECT_EQ(u.grad_state(), Unit::GradState::kReducing);
    u.complete_reduction();
    EXPECT_EQ(u.grad_state(), Unit::GradState::kReduced);
    u.accumulate();
    EXPECT_EQ(u.grad_state(), Unit::GradState::kIdle);
    // Accumulated over the two backward passes, as .grad is without zero_grad().
    const at::Tensor want =
        at::cat({at::full({6}, 1.0), at::full({4}, 2.0), at::full({3}, 3.0)}) * step;
    EXPECT_TRUE(at::equal(u.flat().shard().grad(), want)) << "step " << step;
  }
  // A failed step: any state back to SHARDED / IDLE with the gradient dropped.
  u.arm();
  u.flat().param(0).mutable_grad() = at::full({2, 3}, 1.0);
  u.reset();
  EXPECT_EQ(u.grad_state(), Unit::GradState::kIdle);
  EXPECT_EQ(u.param_state(), Unit::ParamState::kSharded);
  EXPECT_FALSE(u.flat().param(0).grad().defined());
  EXPECT_EQ(u.flat().shard().grad().abs().sum().item<float>(), 0.0f);
  u.arm();  // IDLE again: the next step can start
}

// Gradient sync off: hold() keeps the unit's unsharded gradient (fp32) and the next synced
// backward reduces the sum.
TEST(FsdpUnit, HeldGradientsJoinTheNextReduction) {
  UnitComms comms;
  Recorder rec;
  Unit u(0, "(root)", FlatParam(make_params(), kNames, FlatParamOptions{}), &comms, &rec);
  auto give_grads = [&](double v) {
    u.flat().param(0).mutable_grad() = at::full({2, 3}, v);
    u.flat().param(1).mutable_grad() = at::full({4}, v);
    u.flat().param(2).mutable_grad() = at::full({3}, v);
    for (int i = 0; i < 3; ++i) u.gradient_arrived();
  };
  u.arm();
  give_grads(1.0);
  u.hold();
  EXPECT_EQ(u.grad_state(), Unit::GradState::kHeld);
  EXPECT_EQ(u.param_state(), Unit::ParamState::kSharded)
      << "held units are freed like reduced ones";
  EXPECT_FALSE(u.flat().param(0).grad().defined());
  ASSERT_TRUE(u.held_gradient().defined());
  EXPECT_EQ(u.held_gradient().scalar_type(), at::kFloat);
  expect_internal_error([&] { u.accumulate(); }, "gradient is HELD, accumulate needs REDUCED");
  expect_internal_error([&] { u.replicate(); }, "gradient is HELD, replicate needs REDUCING");
  u.arm();  // from HELD
  give_grads(2.0);
  u.launch_reduction();
  expect_internal_error([&] { u.replicate(); }, "has no replicas to all-reduce over");
  u.complete_reduction();
  u.accumulate();
  EXPECT_FALSE(u.held_gradient().defined()) << "the held sum was reduced and let go";
  EXPECT_TRUE(at::equal(u.flat().shard().grad(), at::full({13}, 3.0)));
  expect_internal_error([&] { u.hold(); }, "gradient is IDLE, hold needs ACCUMULATING");
}

// The schedule's phase moves only through its transitions, each checking where it starts from:
// a refused one names the phase and what the transition needs, and marks the step failed.
TEST(FsdpSchedule, PhaseTransitionsCheckWhereTheyStartFrom) {
  StepFailure failure("FullyShardedDataParallel", 0, 1);
  Schedule s(ScheduleOptions{}, UnitComms{}, failure);  // no groups: gathering is a local copy
  s.add_unit("(root)", nullptr, FlatParam(make_params(), kNames, FlatParamOptions{}));
  auto world = make_communicator(make_memory_store(), 0, 1);  // for end_forward's digest
  EXPECT_EQ(s.phase(), Schedule::Phase::kUnrecorded);
  EXPECT_FALSE(s.failed_in_step());
  expect_internal_error([&] { s.arm(); },
                        "internal error: FSDP schedule is UNRECORDED, arm needs RECORDED");
  EXPECT_TRUE(s.failed_in_step()) << "a refused transition marks the step failed";
  expect_internal_error([&] { s.end_backward(); },
                        "FSDP schedule is UNRECORDED, end_backward needs DRAINING");

  s.begin_forward();
  s.end_forward(*world);
  EXPECT_EQ(s.phase(), Schedule::Phase::kRecorded);
  EXPECT_TRUE(s.order_recorded());
  expect_internal_error([&] { s.disarm(); }, "FSDP schedule is RECORDED, disarm needs ARMED");
  s.begin_forward();  // forwards and evaluations run in RECORDED
  s.end_forward(*world);

  s.arm();
  EXPECT_EQ(s.phase(), Schedule::Phase::kArmed);
  expect_internal_error([&] { s.begin_forward(); },
                        "FSDP schedule is ARMED, begin_forward needs UNRECORDED or RECORDED");
  expect_internal_error([&] { s.arm(); }, "FSDP schedule is ARMED, arm needs RECORDED");
  s.disarm();
  EXPECT_EQ(s.phase(), Schedule::Phase::kDraining);
  expect_internal_error([&] { s.end_forward(*world); },
                        "FSDP schedule is DRAINING, end_forward needs UNRECORDED or RECORDED");
  s.end_backward();
  EXPECT_EQ(s.phase(), Schedule::Phase::kRecorded);

  // A failed step: reset() from the middle of a backward, the order stays recorded.
  s.reset();
  s.arm();
  s.reset();
  EXPECT_EQ(s.phase(), Schedule::Phase::kRecorded);
  EXPECT_EQ(s.unit(0).grad_state(), Unit::GradState::kIdle);
}

}  // namespace
}  // namespace dtrain::fsdp

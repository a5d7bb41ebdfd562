// Every collective x dtype x world size x size, on Gloo with ranks as threads. Expected
// values are computed here in double from the same closed-form inputs, never by dtrain.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "support/check.h"
#include "support/expected_values.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using testing::reduce_expected;
using testing::run_ranks;
using testing::tolerance;
using testing::value;

at::Tensor make_input(c10::ScalarType dtype, int64_t n, int rank, int64_t offset = 0) {
  at::Tensor t = at::empty({n}, at::kDouble);
  auto* p = t.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) p[i] = value(rank, offset + i);
  return t.to(dtype);
}

void expect_values(const at::Tensor& got, const std::function<double(int64_t)>& want,
                   const std::string& what) {
  at::Tensor d = got.to(at::kDouble).contiguous();
  const double* p = d.data_ptr<double>();
  const double tol = tolerance(got.scalar_type());
  for (int64_t i = 0; i < d.numel(); ++i) {
    double w = want(i);
    DTRAIN_CHECK(std::abs(p[i] - w) <= tol * std::max(1.0, std::abs(w)),
                 "{}: element {} is {}, expected {}", what, i, p[i], w);
  }
}

const std::vector<c10::ScalarType> kAllDtypes = {at::kFloat,    at::kDouble, at::kHalf,
                                                 at::kBFloat16, at::kByte,   at::kChar,
                                                 at::kShort,    at::kInt,    at::kLong};

// Sizes per dtype: empty, one, odd, and several MiB for the floating types that carry
// gradients (the large case is what exercises segmentation and the ring).
std::vector<int64_t> sizes_for(c10::ScalarType dtype) {
  std::vector<int64_t> s = {0, 1, 7, 1001};
  if (dtype == at::kFloat || dtype == at::kBFloat16) s.push_back(3 * 512 * 1024 + 3);
  return s;
}

std::vector<ReduceOp> ops_for(c10::ScalarType dtype) {
  std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax};
  if (c10::isFloatingType(dtype)) ops.push_back(ReduceOp::kAvg);
  return ops;
}

std::string label(const char* op, c10::ScalarType dtype, int64_t n, int rank) {
  return fmt::format("{} {} n={} rank {}", op, c10::toString(dtype), n, rank);
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllReduce) {
  const int world = GetParam();
  run_ranks(world, [&](Communicator& c) {
    for (auto dtype : kAllDtypes) {
      for (int64_t n : sizes_for(dtype)) {
        for (ReduceOp op : ops_for(dtype)) {
          at::Tensor t = make_input(dtype, n, c.rank());
          c.all_reduce(t, op)->wait();
          expect_values(
              t, [&](int64_t i) { return reduce_expected(op, world, i); },
              label("all_reduce", dtype, n, c.rank()) + " " + to_string(op));
        }
      }
    }
  });
}

TEST_P(Collectives, Broadcast) {
  const int world = GetParam();
  run_ranks(world, [&](Communicator& c) {
    const int root = world - 1;
    for (auto dtype : kAllDtypes) {
      for (int64_t n : sizes_for(dtype)) {
        at::Tensor t = c.rank() == root ? make_input(dtype, n, root) : at::zeros({n}, dtype);
        c.broadcast(t, root)->wait();
        expect_values(
            t, [&](int64_t i) { return value(root, i); }, label("broadcast", dtype, n, c.rank()));
      }
    }
  });
}

TEST_P(Collectives, AllGather) {
  const int world = GetParam();
  run_ranks(world, [&](Communicator& c) {
    for (auto dtype : kAllDtypes) {
      for (int64_t n : sizes_for(dtype)) {
        at::Tensor in = make_input(dtype, n, c.rank());
        at::Tensor out = at::full({n * world}, -1, dtype);
        c.all_gather(out, in)->wait();
        auto want = [&](int64_t j) { return value(static_cast<int>(j / n), j % n); };
        expect_values(out, want, label("all_gather", dtype, n, c.rank()));
        // In place: the input is this rank's slice of the output, as FSDP uses it.
        at::Tensor flat = at::zeros({n * world}, dtype);
        at::Tensor mine = flat.narrow(0, c.rank() * n, n);
        mine.copy_(in);
        c.all_gather(flat, mine)->wait();
        expect_values(flat, want, label("all_gather(in place)", dtype, n, c.rank()));
      }
    }
  });
}

// Segments far smaller than the chunks: reduce_scatter's pipeline (several segments per
// chunk, a short last one, receive buffers alternating between steps) and Gloo's
// segmented all-reduce, for every dtype and reduction.
TEST_P(Collectives, SegmentedRing) {
  const int world = GetParam();
  CommunicatorOptions options;
  options.gloo_max_segment_bytes = 40;  // 5 doubles, 10 floats, 20 halves, 40 bytes
  run_ranks(
      world,
      [&](Communicator& c) {
        for (auto dtype : kAllDtypes) {
          for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1001}}) {
            for (ReduceOp op : ops_for(dtype)) {
              at::Tensor in = make_input(dtype, n * world, c.rank());
              at::Tensor out = at::full({n}, -1, dtype);
              c.reduce_scatter(out, in, op)->wait();
              const int64_t base = c.rank() * n;
              expect_values(
                  out, [&](int64_t i) { return reduce_expected(op, world, base + i); },
                  label("segmented reduce_scatter", dtype, n, c.rank()) + " " + to_string(op));
              at::Tensor t = make_input(dtype, n, c.rank());
              c.all_reduce(t, op)->wait();
              expect_values(
                  t, [&](int64_t i) { return reduce_expected(op, world, i); },
                  label("segmented all_reduce", dtype, n, c.rank()) + " " + to_string(op));
            }
          }
        }
      },
      options);
}

TEST_P(Collectives, ReduceScatter) {
  const int world = GetParam();
  run_ranks(world, [&](Communicator& c) {
    for (auto dtype : kAllDtypes) {
      for (int64_t n : sizes_for(dtype)) {
        for (ReduceOp op : ops_for(dtype)) {
          at::Tensor in = make_input(dtype, n * world, c.rank());
          at::Tensor before = in.clone();
          at::Tensor out = at::full({n}, -1, dtype);
          c.reduce_scatter(out, in, op)->wait();
          const int64_t base = c.rank() * n;
          expect_values(
              out, [&](int64_t i) { return reduce_expected(op, world, base + i); },
              label("reduce_scatter", dtype, n, c.rank()) + " " + to_string(op));
          DTRAIN_CHECK(at::equal(in, before), "reduce_scatter modified its input");
        }
      }
    }
  });
}

TEST_P(Collectives, SendRecvRing) {
  const int world = GetParam();
  if (world == 1) GTEST_SKIP() << "send/recv needs a peer";
  run_ranks(world, [&](Communicator& c) {
    const int right = (c.rank() + 1) % world;
    const int left = (c.rank() - 1 + world) % world;
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{1 << 20}}) {
      at::Tensor out = make_input(at::kFloat, n, c.rank());
      at::Tensor in = at::zeros({n}, at::kFloat);
      auto s = c.send(out, right, 7);
      auto r = c.recv(in, left, 7);
      s->wait();
      r->wait();
      expect_values(
          in, [&](int64_t i) { return value(left, i); }, label("recv", at::kFloat, n, c.rank()));
    }
  });
}

TEST_P(Collectives, AsyncCallsCompleteInIssueOrderWithSameSequenceOnEveryRank) {
  const int world = GetParam();
  run_ranks(world, [&](Communicator& c) {
    std::vector<at::Tensor> ts;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 6; ++k) {
      ts.push_back(make_input(at::kFloat, 4096 + k, c.rank()));
      works.push_back(c.all_reduce(ts.back()));
    }
    // Waiting in reverse order must not deadlock; completion follows issue order.
    for (int k = 5; k >= 0; --k) works[k]->wait();
    for (int k = 0; k < 6; ++k) {
      DTRAIN_CHECK(works[k]->is_completed() && works[k]->exception() == nullptr, "work {}", k);
      expect_values(
          ts[k], [&](int64_t i) { return reduce_expected(ReduceOp::kSum, world, i); },
          fmt::format("async all_reduce {}", k));
    }
    at::Tensor seqs = at::empty({6 * world}, at::kLong);
    at::Tensor mine = at::empty({6}, at::kLong);
    for (int k = 0; k < 6; ++k) mine[k] = static_cast<int64_t>(works[k]->sequence_number());
    c.all_gather(seqs, mine)->wait();
    for (int r = 1; r < world; ++r)
      DTRAIN_CHECK(at::equal(seqs.narrow(0, 0, 6), seqs.narrow(0, 6 * r, 6)),
                   "sequence numbers differ between rank 0 and rank {}", r);
    for (int k = 1; k < 6; ++k)
      DTRAIN_CHECK(works[k]->sequence_number() == works[k - 1]->sequence_number() + 1, "seq");
    DTRAIN_CHECK(works[0]->op_name() == "all_reduce", "op name {}", works[0]->op_name());
  });
}

TEST_P(Collectives, BarrierWaitsForTheSlowestRank) {
  const int world = GetParam();
  if (world == 1) GTEST_SKIP() << "nothing to wait for";
  run_ranks(world, [&](Communicator& c) {
    if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto start = std::chrono::steady_clock::now();
    c.barrier()->wait();
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (c.rank() != 0) DTRAIN_CHECK(waited > 0.2, "barrier returned after {} s", waited);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(CollectiveArguments, BadInputsThrowInvalidArgumentNamingRankAndOp) {
  run_ranks(2, [&](Communicator& c) {
    auto expect_invalid = [&](const std::function<void()>& f, const std::string& needle) {
      try {
        f();
      } catch (const InvalidArgument& e) {
        std::string msg = e.what();
        DTRAIN_CHECK(msg.find(needle) != std::string::npos, "message '{}' lacks '{}'", msg, needle);
        DTRAIN_CHECK(msg.find(fmt::format("rank {}/2", c.rank())) != std::string::npos,
                     "message '{}' lacks the rank", msg);
        return;
      }
      DTRAIN_CHECK(false, "expected InvalidArgument mentioning '{}'", needle);
    };
    at::Tensor m = at::zeros({4, 4});
    expect_invalid([&] { c.all_reduce(m.t().narrow(0, 0, 2)); }, "contiguous");
    expect_invalid([&] { c.all_gather(at::zeros({5}), at::zeros({2})); }, "all_gather");
    expect_invalid([&] { c.reduce_scatter(at::zeros({2}), at::zeros({5})); }, "padded_size");
    expect_invalid([&] { c.all_reduce(at::zeros({3}, at::kInt), ReduceOp::kAvg); }, "floating");
    expect_invalid([&] { c.broadcast(at::zeros({3}), 2); }, "root");
    expect_invalid([&] { c.send(at::zeros({3}), c.rank()); }, "peer");
    expect_invalid([&] { c.all_reduce(at::zeros({3}, at::kBool)); }, "dtype");
    // Nothing was issued: a valid collective still works.
    at::Tensor t = at::ones({3});
    c.all_reduce(t)->wait();
    DTRAIN_CHECK(t[0].item<float>() == 2.0f, "sum after rejected calls");
  });
}

TEST(CollectiveArguments, PaddedSize) {
  EXPECT_EQ(padded_size(0, 4), 0);
  EXPECT_EQ(padded_size(1, 4), 4);
  EXPECT_EQ(padded_size(8, 4), 8);
  EXPECT_EQ(padded_size(9, 4), 12);
  EXPECT_EQ(padded_size(9, 1), 9);
}

// --- Failures: nothing hangs, errors name rank, op and sequence, and they stick. ---

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(CommFailure, RankThatNeverJoinsMakesOthersTimeOut) {
  auto store = make_memory_store();
  CommunicatorOptions o;
  o.timeout = std::chrono::milliseconds(1000);
  std::vector<std::thread> threads;
  std::atomic<int> timeouts{0};
  std::atomic<double> worst{0};
  for (int r = 0; r < 2; ++r) {  // rank 2 of 3 never comes
    threads.emplace_back([&, r] {
      auto start = std::chrono::steady_clock::now();
      try {
        make_communicator(store, r, 3, o);
      } catch (const TimeoutError& e) {
        ++timeouts;
        double s = seconds_since(start);
        double w = worst.load();
        while (s > w && !worst.compare_exchange_weak(w, s)) {
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(timeouts.load(), 2);
  EXPECT_LT(worst.load(), 2.0 * 1.0 + 0.5);
}

TEST(CommFailure, SilentPeerTimesOutAndTheErrorSticks) {
  CommunicatorOptions o;
  o.timeout = std::chrono::milliseconds(800);
  run_ranks(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) {
          // Alive but never issues the collective.
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          return;
        }
        at::Tensor t = at::ones({16});
        auto start = std::chrono::steady_clock::now();
        bool timed_out = false;
        try {
          c.all_reduce(t)->wait();
        } catch (const TimeoutError& e) {
          timed_out = true;
          std::string msg = e.what();
          DTRAIN_CHECK(msg.find("rank 0/2 all_reduce #0") != std::string::npos, "message: {}", msg);
        }
        DTRAIN_CHECK(timed_out, "all_reduce with a silent peer did not time out");
        DTRAIN_CHECK(seconds_since(start) < 2 * 0.8, "took {} s", seconds_since(start));
        // Sticky: the next call fails at once and names the first failure.
        start = std::chrono::steady_clock::now();
        try {
          c.barrier()->wait();
          DTRAIN_CHECK(false, "barrier on a broken communicator succeeded");
        } catch (const CommError& e) {
          std::string msg = e.what();
          DTRAIN_CHECK(msg.find("failed earlier, at all_reduce #0") != std::string::npos, "{}",
                       msg);
        }
        DTRAIN_CHECK(seconds_since(start) < 0.5, "sticky error took {} s", seconds_since(start));
      },
      o);
}

TEST(CommFailure, PeerThatLeavesMakesOthersFailFast) {
  CommunicatorOptions o;
  o.timeout = std::chrono::milliseconds(5000);
  auto store = make_memory_store();
  std::exception_ptr err;
  double elapsed = 0;
  std::thread leaver([&] {
    make_communicator(store, 1, 2, o); /* destroyed: sockets close */
  });
  std::thread stayer([&] {
    auto c = make_communicator(store, 0, 2, o);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto start = std::chrono::steady_clock::now();
    try {
      at::Tensor t = at::ones({1024});
      c->all_reduce(t)->wait();
    } catch (...) {
      err = std::current_exception();
    }
    elapsed = seconds_since(start);
  });
  leaver.join();
  stayer.join();
  ASSERT_TRUE(err);
  EXPECT_THROW(std::rethrow_exception(err), CommError);
  EXPECT_LT(elapsed, 2 * 5.0);
}

}  // namespace
}  // namespace dtrain

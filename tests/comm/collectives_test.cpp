// Every collective x dtype x world size x size on every CPU transport (Gloo, shared
// memory), ranks as threads: the one matrix (support/collective_matrix.h), Gloo's segmented
// ring, send/recv, issue order; failures: nothing hangs, errors name rank, op and sequence,
// and they stick.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "support/check.h"
#include "support/collective_matrix.h"
#include "support/expected_values.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// A CPU transport under test, named as Communicator::transport_name() reports it.
struct TransportCase {
  Transport transport;
  std::string name;
};
void PrintTo(const TransportCase& t, std::ostream* os) { *os << t.name; }
const std::vector<TransportCase> kTransports = {{Transport::kGloo, "gloo"},
                                                {Transport::kSharedMemory, "shared_memory"}};

CommunicatorOptions on(Transport transport) {
  CommunicatorOptions o;
  o.transport = transport;
  return o;
}

class Collectives : public ::testing::TestWithParam<std::tuple<TransportCase, int>> {
 protected:
  Transport transport() const { return std::get<0>(GetParam()).transport; }
  const std::string& transport_name() const { return std::get<0>(GetParam()).name; }
  int world() const { return std::get<1>(GetParam()); }
};

TEST_P(Collectives, EveryOpDtypeAndSize) {
  run_ranks(
      world(), [&](Communicator& c) { run_collective_matrix(c, transport_name()); },
      on(transport()));
}

// Segments far smaller than the chunks: reduce_scatter's pipeline (several segments per
// chunk, a short last one, receive buffers alternating between steps) and Gloo's
// segmented all-reduce, for every dtype and reduction.
class GlooSegments : public ::testing::TestWithParam<int> {};

TEST_P(GlooSegments, ReduceScatterAndAllReduce) {
  const int world = GetParam();
  CommunicatorOptions options = on(Transport::kGloo);
  options.gloo_max_segment_bytes = 40;  // 5 doubles, 10 floats, 20 halves, 40 bytes
  run_ranks(
      world,
      [&](Communicator& c) {
        DTRAIN_CHECK(c.transport_name() == std::string("gloo"), "transport {}", c.transport_name());
        for (auto dtype : all_dtypes()) {
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

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooSegments, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST_P(Collectives, SendRecvRing) {
  const int world = this->world();
  if (world == 1) GTEST_SKIP() << "send/recv needs a peer";
  run_ranks(
      world,
      [&](Communicator& c) {
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
              in, [&](int64_t i) { return value(left, i); },
              label("recv", at::kFloat, n, c.rank()));
        }
      },
      on(transport()));
}

TEST_P(Collectives, AsyncCallsCompleteInIssueOrderWithSameSequenceOnEveryRank) {
  const int world = this->world();
  run_ranks(
      world,
      [&](Communicator& c) {
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
      },
      on(transport()));
}

TEST_P(Collectives, BarrierWaitsForTheSlowestRank) {
  const int world = this->world();
  if (world == 1) GTEST_SKIP() << "nothing to wait for";
  run_ranks(
      world,
      [&](Communicator& c) {
        if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        auto start = std::chrono::steady_clock::now();
        c.barrier()->wait();
        double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (c.rank() != 0) DTRAIN_CHECK(waited > 0.2, "barrier returned after {} s", waited);
      },
      on(transport()));
}

INSTANTIATE_TEST_SUITE_P(TransportsAndWorldSizes, Collectives,
                         ::testing::Combine(::testing::ValuesIn(kTransports),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

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

class TransportFailure : public ::testing::TestWithParam<TransportCase> {};

// Rank 1 is alive but never issues the collective: rank 0 times out within the timeout's
// bound, naming itself, the call and the missing rank, and the error sticks.
TEST_P(TransportFailure, SilentPeerTimesOutNamingItAndTheErrorSticks) {
  CommunicatorOptions o = on(GetParam().transport);
  o.timeout = std::chrono::milliseconds(800);
  run_ranks(
      2,
      [&](Communicator& c) {
        DTRAIN_CHECK(c.transport_name() == GetParam().name, "transport {}", c.transport_name());
        if (c.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          return;
        }
        at::Tensor t = at::ones({1 << 16});
        auto start = std::chrono::steady_clock::now();
        try {
          c.all_reduce(t)->wait();
          DTRAIN_CHECK(false, "all_reduce with a silent peer did not time out");
        } catch (const TimeoutError& e) {
          const std::string msg = e.what();
          DTRAIN_CHECK(msg.find("rank 0/2 all_reduce #0") != std::string::npos &&
                           msg.find("rank(s) 1 did not issue collective #0 within 800 ms") !=
                               std::string::npos,
                       "message: {}", msg);
        }
        DTRAIN_CHECK(seconds_since(start) < 2 * 0.8, "took {} s", seconds_since(start));
        // Sticky: the next call fails at once and names the first failure.
        start = std::chrono::steady_clock::now();
        try {
          c.barrier()->wait();
          DTRAIN_CHECK(false, "barrier on a broken communicator succeeded");
        } catch (const CommError& e) {
          const std::string msg = e.what();
          DTRAIN_CHECK(msg.find("failed earlier, at all_reduce #0") != std::string::npos, "{}",
                       msg);
        }
        DTRAIN_CHECK(seconds_since(start) < 0.5, "sticky error took {} s", seconds_since(start));
      },
      o);
}

// Rank 1 destroys its communicator while rank 0 waits in a collective: rank 0 fails long
// before its 5 s timeout (shared memory reads the peer's state in the segment and names it;
// Gloo sees the connection close).
TEST_P(TransportFailure, PeerThatLeavesMakesOthersFailFast) {
  CommunicatorOptions o = on(GetParam().transport);
  o.timeout = std::chrono::milliseconds(5000);
  auto store = make_memory_store();
  std::string error;
  double elapsed = 0;
  std::thread leaver([&] { make_communicator(store, 1, 2, o); });
  std::thread stayer([&] {
    auto c = make_communicator(store, 0, 2, o);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto start = std::chrono::steady_clock::now();
    try {
      at::Tensor t = at::ones({1024});
      c->all_reduce(t)->wait();
    } catch (const CommError& e) {
      error = e.what();
    }
    elapsed = seconds_since(start);
  });
  leaver.join();
  stayer.join();
  ASSERT_FALSE(error.empty()) << "no CommError";
  if (GetParam().transport == Transport::kSharedMemory) {
    EXPECT_NE(error.find("rank 1 left: its communicator was destroyed"), std::string::npos)
        << error;
  }
  EXPECT_LT(elapsed, 1.0) << error;
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportFailure, ::testing::ValuesIn(kTransports),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dtrain

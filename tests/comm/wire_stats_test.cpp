// Bytes on the wire (dtrain/wire_stats.h, docs/communication.md "Bytes on the wire"): the
// counts of every collective against the closed forms of its algorithm, at 2 and 4 ranks, on
// Gloo's TCP pairs and on shared memory (one host: all intra-host; fake hosts, intra vs
// inter: shm_test), and Gloo's timeouts told from its other failures by state, not text.
#include <ATen/ATen.h>
#include <gloo/common/error.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "comm/call_header.h"
#include "comm/gloo/bounded_wait.h"
#include "comm/gloo/wire_bytes.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/wire_stats.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using dtrain::testing::run_ranks;

constexpr uint64_t kHeader = sizeof(detail::CallHeader);

// What each rank sent in each of the calls below, one WireStats per call.
struct Sent {
  WireStats all_reduce, all_reduce_uneven, all_gather, reduce_scatter, broadcast, send, barrier;
};

// n = 4096 floats: Gloo's ring cuts it into equal segments (2 per rank at 2 and 4 ranks).
constexpr int64_t kEven = 4096;
constexpr int64_t kUneven = 1001;  // 4004 bytes: short and empty last segments
constexpr int64_t kBlock = 1000;   // per-rank block of all_gather / reduce_scatter, send

// Runs the calls on `world` ranks of one host over `transport`; checks that every call was
// counted and that nothing crossed hosts.
std::vector<Sent> run_on_one_host(int world, Transport transport) {
  CommunicatorOptions options;
  options.transport = transport;
  std::vector<Sent> sent(static_cast<size_t>(world));
  run_ranks(
      world,
      [&](Communicator& c) {
        Sent& s = sent[static_cast<size_t>(c.rank())];
        auto measure = [&](WireStats& out, auto&& call) {
          const WireStats before = wire_stats(c);
          call();
          out = wire_stats(c).since(before);
        };
        measure(s.all_reduce, [&] { c.all_reduce_sync(at::ones({kEven})); });
        measure(s.all_reduce_uneven, [&] { c.all_reduce_sync(at::ones({kUneven})); });
        measure(s.all_gather,
                [&] { c.all_gather_sync(at::empty({world * kBlock}), at::ones({kBlock})); });
        measure(s.reduce_scatter,
                [&] { c.reduce_scatter_sync(at::empty({kBlock}), at::ones({world * kBlock})); });
        measure(s.broadcast, [&] { c.broadcast_sync(at::ones({kBlock}), 1); });
        measure(s.send, [&] {
          at::Tensor t = at::ones({kBlock});
          if (c.rank() == 0) c.send(t, 1)->wait();
          if (c.rank() == 1) c.recv(t, 0)->wait();
        });
        measure(s.barrier, [&] { c.barrier_sync(); });
      },
      options);
  for (size_t r = 0; r < sent.size(); ++r) {
    for (WireStats Sent::*call :
         {&Sent::all_reduce, &Sent::all_reduce_uneven, &Sent::all_gather, &Sent::reduce_scatter,
          &Sent::broadcast, &Sent::send, &Sent::barrier}) {
      const WireStats& w = sent[r].*call;
      EXPECT_TRUE(w.counted) << "rank " << r;
      EXPECT_EQ(w.total().inter_host, 0u) << "rank " << r;
    }
  }
  return sent;
}

uint64_t sum(const std::vector<Sent>& sent, WireStats Sent::*call, WireBytes WireStats::*kind) {
  uint64_t total = 0;
  for (const Sent& s : sent) total += (s.*call.*kind).intra_host;
  return total;
}

class WireBytesOnGloo : public ::testing::TestWithParam<int> {};

TEST_P(WireBytesOnGloo, EqualTheRingAndTreeClosedForms) {
  const int w = GetParam();
  const auto n = static_cast<uint64_t>(w);
  const std::vector<Sent> sent = run_on_one_host(w, Transport::kGloo);
  const uint64_t even = kEven * 4, uneven = kUneven * 4, block = kBlock * 4;
  for (int r = 0; r < w; ++r) {
    const Sent& s = sent[static_cast<size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    // Ring all-reduce: 2 (n - 1) / n of the buffer, to one neighbour.
    EXPECT_EQ(s.all_reduce.all_reduce.intra_host, 2 * (n - 1) * even / n);
    // Rings of n - 1 steps, one block each.
    EXPECT_EQ(s.all_gather.all_gather.intra_host, (n - 1) * block);
    EXPECT_EQ(s.reduce_scatter.reduce_scatter.intra_host, (n - 1) * block);
    // Only rank 0 sends; recv sends nothing.
    EXPECT_EQ(s.send.point_to_point.intra_host, r == 0 ? block : 0u);
    // Every collective's header goes to every peer; send/recv have none.
    for (const WireStats* call :
         {&s.all_reduce, &s.all_gather, &s.reduce_scatter, &s.broadcast, &s.barrier}) {
      EXPECT_EQ(call->control.intra_host, (n - 1) * kHeader);
    }
    EXPECT_EQ(s.send.control.intra_host, 0u);
    EXPECT_EQ(s.barrier.total().intra_host, (n - 1) * kHeader);
  }
  // Uneven segments differ per rank, but every byte of the buffer still leaves n - 1 ranks
  // in each phase.
  EXPECT_EQ(sum(sent, &Sent::all_reduce_uneven, &WireStats::all_reduce), 2 * (n - 1) * uneven);
  // Binomial tree: every rank but the root receives the buffer once; the root (rank 1)
  // sends it log2(n) times.
  EXPECT_EQ(sum(sent, &Sent::broadcast, &WireStats::broadcast), (n - 1) * block);
  EXPECT_EQ(sent[1].broadcast.broadcast.intra_host, (n == 4 ? 2 : 1) * block);
}

// Shared memory: what each rank writes into the segment for the others.
TEST_P(WireBytesOnGloo, SharedMemoryCountsWhatRanksWriteIntoTheSegment) {
  const int w = GetParam();
  const auto n = static_cast<uint64_t>(w);
  const std::vector<Sent> sent = run_on_one_host(w, Transport::kSharedMemory);
  const uint64_t even = kEven * 4, block = kBlock * 4;
  for (int r = 0; r < w; ++r) {
    const Sent& s = sent[static_cast<size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    // Its input, then its reduced slice (1/n of the buffer; n divides 4096).
    EXPECT_EQ(s.all_reduce.all_reduce.intra_host, even + even / n);
    EXPECT_EQ(s.all_gather.all_gather.intra_host, block);
    EXPECT_EQ(s.reduce_scatter.reduce_scatter.intra_host, n * block);
    EXPECT_EQ(s.broadcast.broadcast.intra_host, r == 1 ? block : 0u);
    EXPECT_EQ(s.send.point_to_point.intra_host, r == 0 ? block : 0u);  // through Gloo
    EXPECT_EQ(s.barrier.total().intra_host, kHeader);                  // one header per call
  }
  // Each rank's slices of an uneven buffer differ; all slices make the buffer once.
  EXPECT_EQ(sum(sent, &Sent::all_reduce_uneven, &WireStats::all_reduce), (n + 1) * kUneven * 4);
}

INSTANTIATE_TEST_SUITE_P(Worlds, WireBytesOnGloo, ::testing::Values(2, 4));

// The schedules replayed for Gloo's own collectives, at sizes Gloo pads and segments.
TEST(WireBytesSchedules, RingAllReduceSumsToTwiceTheBufferPerRankButOne) {
  for (int w : {2, 3, 4, 7}) {
    for (size_t bytes : {size_t{4}, size_t{8}, size_t{4004}, size_t{16384}, size_t{1} << 20}) {
      for (size_t segment : {size_t{40}, size_t{4} << 20}) {
        uint64_t total = 0;
        for (int r = 0; r < w; ++r) {
          total += gloo_backend::ring_all_reduce_bytes(bytes, 4, segment, r, w);
        }
        EXPECT_EQ(total, 2 * static_cast<uint64_t>(w - 1) * bytes)
            << w << " ranks, " << bytes << " bytes, segments of " << segment;
      }
    }
  }
  EXPECT_EQ(gloo_backend::ring_all_reduce_bytes(4096, 4, 4 << 20, 0, 1), 0u);
}

TEST(WireBytesSchedules, BroadcastTreeReachesEveryRankOnce) {
  for (int w : {1, 2, 3, 4, 5, 8}) {
    for (int root = 0; root < w; ++root) {
      std::vector<int> received(static_cast<size_t>(w), 0);
      for (int r = 0; r < w; ++r) {
        for (int peer : gloo_backend::broadcast_peers(r, root, w)) {
          ++received[static_cast<size_t>(peer)];
        }
      }
      for (int r = 0; r < w; ++r) EXPECT_EQ(received[static_cast<size_t>(r)], r == root ? 0 : 1);
    }
  }
}

// --- Gloo's failures, classified by state (gloo/bounded_wait.h) ---

TEST(GlooBoundedWait, AnIoExceptionAfterTheTimeoutIsATimeoutWhateverItsText) {
  try {
    gloo_backend::bounded_wait(std::chrono::milliseconds(20), [] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      throw gloo::IoException("Connection reset by peer\nstack trace");
    });
    ADD_FAILURE() << "no error";
  } catch (const TimeoutError& e) {
    EXPECT_EQ(e.cause(), "Connection reset by peer");  // first line only
  }
}

TEST(GlooBoundedWait, AnIoExceptionBeforeTheTimeoutIsACommErrorWhateverItsText) {
  try {
    gloo_backend::bounded_wait(std::chrono::milliseconds(60000), [] {
      throw gloo::IoException("Timed out waiting 1000ms for recv operation to complete");
    });
    ADD_FAILURE() << "no error";
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << "classified as a timeout: " << e.what();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("Timed out waiting"), std::string::npos) << e.what();
  }
}

TEST(GlooBoundedWait, ATimeoutCanNameItsCause) {
  try {
    gloo_backend::bounded_wait(
        std::chrono::milliseconds(1),
        [] {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          throw gloo::IoException("x");
        },
        [](const std::string&) { return TimeoutError("rank 1 did not send"); });
    ADD_FAILURE() << "no error";
  } catch (const TimeoutError& e) {
    EXPECT_EQ(e.cause(), "rank 1 did not send");
  }
}

}  // namespace
}  // namespace dtrain

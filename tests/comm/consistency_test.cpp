// Ranks that disagree about a collective: every rank raises DesyncError naming both sides,
// before any data moved (never an abort, a hang or wrong numbers); failures on the
// communicator's threads become dtrain errors; concurrent issuers get one numbering.
#include <ATen/ATen.h>
#include <gloo/common/error.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/failure.h"
#include "comm/nccl/tag_policy.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"
#include "support/check.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using testing::run_ranks;

CommunicatorOptions quick(Consistency consistency = Consistency::kCheap) {
  CommunicatorOptions o;
  // Short: against code without the check, a mismatch hangs until this timeout.
  o.timeout = std::chrono::milliseconds(4000);
  o.consistency = consistency;
  return o;
}

// Runs `issue` on every rank and requires it to fail with DesyncError whose message holds
// every needle; then the communicator must be broken (sticky) naming that call.
void expect_desync(int world, const std::function<WorkPtr(Communicator&)>& issue,
                   const std::vector<std::string>& needles, CommunicatorOptions options = quick()) {
  std::atomic<int> raised{0};
  run_ranks(
      world,
      [&](Communicator& c) {
        std::string msg;
        try {
          issue(c)->wait();
        } catch (const DesyncError& e) {
          msg = e.what();
        }
        DTRAIN_CHECK(!msg.empty(), "rank {}: the mismatched collective did not raise DesyncError",
                     c.rank());
        for (const auto& needle : needles)
          DTRAIN_CHECK(msg.find(needle) != std::string::npos, "rank {}: '{}' lacks '{}'", c.rank(),
                       msg, needle);
        DTRAIN_CHECK(msg.find(fmt::format("rank {}/{}", c.rank(), world)) != std::string::npos,
                     "'{}' lacks the rank", msg);
        ++raised;
        try {
          c.barrier()->wait();
          DTRAIN_CHECK(false, "rank {}: barrier after a desync succeeded", c.rank());
        } catch (const CommError& e) {
          const std::string again = e.what();
          DTRAIN_CHECK(again.find("failed earlier") != std::string::npos, "{}", again);
        }
      },
      options);
  EXPECT_EQ(raised.load(), world);
}

TEST(Consistency, DifferentSizesRaiseDesyncOnEveryRankNamingBothSides) {
  expect_desync(
      2, [](Communicator& c) { return c.all_reduce(at::ones({c.rank() == 0 ? 1024 : 512})); },
      {"rank 0 issued all_reduce #0 float32[1024] sum; rank 1 issued all_reduce #0 float32[512] "
       "sum"});
}

TEST(Consistency, OneRankOfThreeDiffersAfterMatchingCalls) {
  expect_desync(
      3,
      [](Communicator& c) {
        at::Tensor t = at::ones({16});
        c.all_reduce(t)->wait();
        DTRAIN_CHECK(t[0].item<float>() == 3.0f, "matching call: {}", t[0].item<float>());
        c.barrier()->wait();
        return c.all_reduce(at::ones({c.rank() == 2 ? 7 : 8}));
      },
      {"rank 0 issued all_reduce #2 float32[8] sum; rank 2 issued all_reduce #2 float32[7] sum"});
}

TEST(Consistency, SameElementSizeOtherDtypeRaisesDesync) {
  expect_desync(2,
                [](Communicator& c) {
                  return c.all_reduce(at::ones({256}, c.rank() == 0 ? at::kFloat : at::kInt));
                },
                {"rank 0 issued all_reduce #0 float32[256] sum",
                 "rank 1 issued all_reduce #0 int32[256] sum"});
}

TEST(Consistency, DifferentOperationsRaiseDesync) {
  expect_desync(2,
                [](Communicator& c) {
                  at::Tensor t = at::ones({64});
                  return c.rank() == 0 ? c.all_reduce(t) : c.broadcast(t, 0);
                },
                {"rank 0 issued all_reduce #0 float32[64] sum; rank 1 issued broadcast #0 "
                 "float32[64] root 0"});
}

TEST(Consistency, AllGatherAndReduceScatterSizesAreChecked) {
  expect_desync(2,
                [](Communicator& c) {
                  const int64_t n = c.rank() == 0 ? 100 : 60;
                  return c.all_gather(at::zeros({2 * n}), at::ones({n}));
                },
                {"all_gather #0 float32[100]", "all_gather #0 float32[60]"});
  expect_desync(2,
                [](Communicator& c) {
                  const int64_t n = c.rank() == 0 ? 50 : 40;
                  return c.reduce_scatter(at::zeros({n}), at::ones({2 * n}));
                },
                {"reduce_scatter #0 float32[100] sum", "reduce_scatter #0 float32[80] sum"});
}

TEST(Consistency, BarrierAgainstCollectiveRaisesDesync) {
  expect_desync(
      2, [](Communicator& c) { return c.rank() == 0 ? c.barrier() : c.all_reduce(at::ones({4})); },
      {"rank 0 issued barrier #0; rank 1 issued all_reduce #0 float32[4] sum"});
}

TEST(Consistency, FingerprintCatchesReduceOpRootAndShape) {
  const CommunicatorOptions fp = quick(Consistency::kFingerprint);
  expect_desync(
      2,
      [](Communicator& c) {
        return c.all_reduce(at::ones({32}), c.rank() == 0 ? ReduceOp::kSum : ReduceOp::kMax);
      },
      {"float32[32] sum; rank 1 issued all_reduce #0 float32[32] max"}, fp);
  expect_desync(
      2, [](Communicator& c) { return c.broadcast(at::ones({8}), c.rank()); },
      {"rank 0 issued broadcast #0 float32[8] root 0; rank 1 issued broadcast #0 float32[8] root "
       "1"},
      fp);
  expect_desync(
      2,
      [](Communicator& c) {
        return c.all_reduce(c.rank() == 0 ? at::ones({2, 8}) : at::ones({16}));
      },
      {"rank 0 issued all_reduce #0 float32[2, 8] sum; rank 1 issued all_reduce #0 float32[16] sum",
       "fingerprint"},
      fp);
}

// Reductions and roots that differ corrupt results silently, so the always-on check compares
// them too; a shape that differs with the same element count moves the same bytes.
TEST(Consistency, CheapCheckCoversReduceOpAndRootButNotShape) {
  expect_desync(2,
                [](Communicator& c) {
                  return c.all_reduce(at::ones({32}),
                                      c.rank() == 0 ? ReduceOp::kSum : ReduceOp::kMin);
                },
                {"sum; rank 1 issued all_reduce #0 float32[32] min"});
  expect_desync(2, [](Communicator& c) { return c.broadcast(at::ones({8}), c.rank()); },
                {"root 0", "root 1"});
  run_ranks(
      2,
      [](Communicator& c) {
        at::Tensor t = c.rank() == 0 ? at::ones({2, 8}) : at::ones({16});
        c.all_reduce(t)->wait();
        DTRAIN_CHECK(t.flatten()[15].item<float>() == 2.0f, "sum {}",
                     t.flatten()[15].item<float>());
      },
      quick());
}

TEST(Consistency, StrictestLevelOfAnyRankApplies) {
  auto store = make_memory_store();
  std::atomic<int> raised{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto c = make_communicator(store, r, 2,
                                 quick(r == 0 ? Consistency::kFingerprint : Consistency::kCheap));
      try {
        c->all_reduce(r == 0 ? at::ones({2, 3}) : at::ones({6}))->wait();
      } catch (const DesyncError&) {
        ++raised;
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(raised.load(), 2);
}

TEST(Consistency, SilentPeerTimesOutNamingIt) {
  run_ranks(
      2,
      [](Communicator& c) {
        if (c.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1500));
          return;
        }
        CallOptions o;
        o.timeout = std::chrono::milliseconds(500);
        try {
          c.all_reduce(at::ones({4}), ReduceOp::kSum, o)->wait();
          DTRAIN_CHECK(false, "no timeout");
        } catch (const TimeoutError& e) {
          const std::string msg = e.what();
          DTRAIN_CHECK(
              msg.find("rank(s) 1 did not issue collective #0 within 500 ms") != std::string::npos,
              "{}", msg);
        }
      },
      quick());
}

TEST(Consistency, EnvironmentRaisesTheLevelThroughLaunchInfo) {
  using Env = std::map<std::string, std::string>;
  const LaunchInfo fp = LaunchInfo::from_env(Env{{"DTRAIN_COLLECTIVE_CHECK", "fingerprint"}});
  EXPECT_EQ(fp.consistency, Consistency::kFingerprint);
  EXPECT_EQ(fp.communicator_options().consistency, Consistency::kFingerprint);
  const LaunchInfo cheap = LaunchInfo::from_env(Env{{"DTRAIN_COLLECTIVE_CHECK", "cheap"}});
  CommunicatorOptions asked;
  asked.consistency = Consistency::kFingerprint;
  EXPECT_EQ(cheap.communicator_options(asked).consistency, Consistency::kFingerprint);
  EXPECT_EQ(LaunchInfo::from_env(Env{}).communicator_options().consistency, Consistency::kCheap);
  try {
    LaunchInfo::from_env(Env{{"DTRAIN_COLLECTIVE_CHECK", "full"}});
    ADD_FAILURE() << "accepted DTRAIN_COLLECTIVE_CHECK=full";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_COLLECTIVE_CHECK='full'"), std::string::npos)
        << e.what();
  }
}

// --- Failures raised on the communicator's threads become dtrain errors. ---

TEST(ThreadFailures, AnythingThrownBecomesADtrainErrorNamingTheCall) {
  const ErrorContext ctx{1, 4, "all_reduce", 17};
  auto message = [](const std::exception_ptr& e) -> std::string {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    }
  };
  {
    detail::StickyFailure f;
    auto e = f.run(ctx, [] {
      throw gloo::IoException(
          "[gloo/transport/tcp/pair.cc:598] Connection closed by peer\n"
          "frame #0 ...");
    });
    EXPECT_THROW(std::rethrow_exception(e), CommError);
    EXPECT_EQ(message(e),
              "dtrain [rank 1/4 all_reduce #17]: [gloo/transport/tcp/pair.cc:598] Connection "
              "closed by peer");
    // Sticky: the next call does not run and names the first failure.
    bool ran = false;
    auto later = f.run(ErrorContext{1, 4, "barrier", 18}, [&] { ran = true; });
    EXPECT_FALSE(ran);
    EXPECT_NE(message(later).find("failed earlier, at all_reduce #17: [gloo"), std::string::npos)
        << message(later);
  }
  {
    detail::StickyFailure f;
    auto e = f.run(ctx, [] { throw 42; });
    EXPECT_THROW(std::rethrow_exception(e), CommError);
    EXPECT_NE(message(e).find("not a std::exception"), std::string::npos) << message(e);
  }
  {
    // A foreign exception is never classified by its text: the engine's bounded wait
    // (gloo/bounded_wait.h) turns a wait that ran out into TimeoutError before this point.
    detail::StickyFailure f;
    auto e = f.run(ctx, [] {
      throw gloo::IoException("Timed out waiting 500ms for recv operation to complete");
    });
    EXPECT_THROW(std::rethrow_exception(e), CommError);
    bool timeout = false;
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError&) {
      timeout = true;
    } catch (const CommError&) {
    }
    EXPECT_FALSE(timeout) << "classified by its text: " << message(e);
  }
  {
    detail::StickyFailure f;
    auto e = f.run(ctx, [] { throw TimeoutError("recv ran out after 500ms"); });
    EXPECT_THROW(std::rethrow_exception(e), TimeoutError);
    EXPECT_NE(message(e).find("[rank 1/4 all_reduce #17]"), std::string::npos) << message(e);
  }
  {
    detail::StickyFailure f;
    auto e = f.run(ctx, [] { throw DesyncError("ranks issued different collectives"); });
    EXPECT_THROW(std::rethrow_exception(e), DesyncError);
    EXPECT_NE(message(e).find("[rank 1/4 all_reduce #17]"), std::string::npos) << message(e);
  }
}

// A peer that closes its connections mid-collective: Gloo's pair thread sees it and the
// executor's wait throws Gloo's IoException, which must arrive as a CommError naming the call.
TEST(ThreadFailures, PeerLeavingMidCollectiveIsACommErrorNamingTheCall) {
  auto store = make_memory_store();
  CommunicatorOptions o = quick();
  std::string msg;
  std::thread leaver([&] {
    auto c = make_communicator(store, 1, 2, o);
    c->barrier()->wait();
  });  // destroyed: its sockets close
  std::thread stayer([&] {
    auto c = make_communicator(store, 0, 2, o);
    c->barrier()->wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    try {
      c->all_reduce(at::ones({1 << 16}))->wait();
    } catch (const TimeoutError& e) {
      msg = std::string("timeout: ") + e.what();
    } catch (const CommError& e) {
      msg = e.what();
    }
  });
  leaver.join();
  stayer.join();
  EXPECT_NE(msg.find("dtrain [rank 0/2 all_reduce #1]"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("timeout"), std::string::npos) << msg;
}

// A receive smaller than the message it matched used to abort inside Gloo's thread; another
// dtype of the same width was reinterpreted silently. Size and dtype are now part of the
// match: the side that times out first names the likely cause (and Gloo then closes its
// connections, so the other side may see "connection closed" first).
// NCCL matches sends and recvs in issue order and has no tags: its backend refuses a tag
// rather than ignore it (the check is plain C++, tested here without NCCL or a GPU).
TEST(PointToPoint, NcclRefusesTagsInsteadOfIgnoringThem) {
  const ErrorContext ctx{1, 2, "send", 4};
  EXPECT_NO_THROW(nccl_backend::check_tag(0, ctx));
  for (uint32_t tag : {1u, 0x636b7074u, 0xffffffffu}) {
    try {
      nccl_backend::check_tag(tag, ctx);
      ADD_FAILURE() << "tag " << tag << " accepted";
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("tag " + std::to_string(tag)), std::string::npos) << msg;
      EXPECT_NE(msg.find("NCCL has no tags"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 1/2 send"), std::string::npos) << msg;
    }
  }
}

TEST(PointToPoint, SizeOrDtypeMismatchTimesOutInsteadOfAborting) {
  for (bool same_size : {false, true}) {
    std::mutex mu;
    std::vector<std::string> named;
    run_ranks(
        2,
        [&](Communicator& c) {
          CallOptions o;
          o.timeout = std::chrono::milliseconds(500);
          at::Tensor t = c.rank() == 0 ? at::ones({8})
                         : same_size   ? at::zeros({8}, at::kInt)
                                       : at::zeros({4});
          try {
            (c.rank() == 0 ? c.send(t, 1, 3, o) : c.recv(t, 0, 3, o))->wait();
            DTRAIN_CHECK(false, "rank {}: a mismatched send/recv completed", c.rank());
          } catch (const CommError& e) {
            const std::string msg = e.what();
            if (msg.find("another size or dtype") != std::string::npos) {
              DTRAIN_CHECK(msg.find("with tag 3 on rank") != std::string::npos, "{}", msg);
              std::lock_guard<std::mutex> lock(mu);
              named.push_back(msg);
            } else {
              DTRAIN_CHECK(msg.find("Connection closed by peer") != std::string::npos, "{}", msg);
            }
          }
        },
        quick());
    EXPECT_FALSE(named.empty()) << "no rank named the mismatch (same_size " << same_size << ")";
  }
}

// --- Several threads issuing on one communicator. ---

// Numbering and queueing are one step: every rank executes its calls in the order it
// numbered them, so calls that look alike always pair up, whatever the interleaving.
TEST(ConcurrentIssuers, AlikeCallsFromTwoThreadsAllComplete) {
  constexpr int kPerThread = 150;
  run_ranks(
      2,
      [](Communicator& c) {
        std::vector<WorkPtr> works(2 * kPerThread);
        std::vector<at::Tensor> ts(2 * kPerThread);
        auto issue = [&](int t) {
          for (int k = 0; k < kPerThread; ++k) {
            const int i = t * kPerThread + k;
            ts[i] = at::full({8}, static_cast<float>(c.rank() + 1));
            works[i] = c.all_reduce(ts[i]);
          }
        };
        std::thread a(issue, 0), b(issue, 1);
        a.join();
        b.join();
        std::vector<bool> seen(2 * kPerThread, false);
        for (int i = 0; i < 2 * kPerThread; ++i) {
          works[i]->wait();
          DTRAIN_CHECK(ts[i][0].item<float>() == 3.0f, "call {}: {}", i, ts[i][0].item<float>());
          const uint64_t seq = works[i]->sequence_number();
          DTRAIN_CHECK(seq < seen.size() && !seen[seq], "sequence number {} twice", seq);
          seen[seq] = true;
        }
      },
      quick());
}

// Calls that differ, racing: ranks may order them differently. Either they happen to pair
// up, or every rank gets DesyncError; never an abort, a hang or mixed-up data.
TEST(ConcurrentIssuers, RacingCallsThatDifferAreRefusedClearly) {
  constexpr int kPerThread = 60;
  std::atomic<int> desyncs{0};
  run_ranks(
      2,
      [&](Communicator& c) {
        std::vector<WorkPtr> works(2 * kPerThread);
        std::vector<at::Tensor> ts(2 * kPerThread);
        auto issue = [&](int t) {
          for (int k = 0; k < kPerThread; ++k) {
            const int i = t * kPerThread + k;
            ts[i] = at::full({t == 0 ? 8 : 9}, static_cast<float>(c.rank() + 1));
            works[i] = c.all_reduce(ts[i]);
          }
        };
        std::thread a(issue, 0), b(issue, 1);
        a.join();
        b.join();
        for (int i = 0; i < 2 * kPerThread; ++i) {
          try {
            works[i]->wait();
            DTRAIN_CHECK(ts[i][0].item<float>() == 3.0f, "call {}: {}", i, ts[i][0].item<float>());
          } catch (const DesyncError&) {
            ++desyncs;
          } catch (const TimeoutError& e) {
            DTRAIN_CHECK(false, "racing calls hung: {}", e.what());
          } catch (const CommError& e) {
            DTRAIN_CHECK(std::string(e.what()).find("failed earlier") != std::string::npos, "{}",
                         e.what());
          }
        }
      },
      quick());
  // Both ranks fail together, or neither does.
  EXPECT_TRUE(desyncs.load() == 0 || desyncs.load() == 2) << desyncs.load();
}

// --- Separate processes. ---

TEST(ConsistencyProcesses, DifferentSizesRaiseDesyncInEveryProcess) {
  const int port = testing::free_port();
  std::vector<testing::Process> ps;
  for (int r = 0; r < 2; ++r) {
    ps.push_back(testing::spawn_process({DTRAIN_TEST_WORKER, "desync_size", "10000"},
                                        testing::rank_env(r, 2, port)));
  }
  for (int r = 0; r < 2; ++r) {
    auto res = testing::wait_process(ps[r], 60);
    EXPECT_EQ(res.signal, 0) << "rank " << r << " was killed by a signal:\n" << res.output;
    EXPECT_EQ(res.exit_code, 5) << "rank " << r << ":\n" << res.output;
    EXPECT_NE(res.output.find("rank 0 issued all_reduce #0 float32[1024] sum; rank 1 issued "
                              "all_reduce #0 float32[512] sum"),
              std::string::npos)
        << res.output;
  }
}

}  // namespace
}  // namespace dtrain

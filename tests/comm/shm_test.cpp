// The shared-memory transport (its part of the collectives matrix is in collectives_test):
// the matrix with chunks small enough that calls take many, bit-exact rank-order reductions,
// the hierarchical transport over fake hosts (bytes on the wire intra vs inter host too),
// selection (automatic, forced, refused),
// the consistency check, and failures: a failed send, a killed process, a stale segment
// under the name a job would use, nothing left in /dev/shm (a silent peer and a peer that
// leaves: collectives_test, for every transport).
#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/backend_factory.h"
#include "comm/call_header.h"
#include "comm/front_end.h"
#include "comm/shm/segment.h"
#include "comm/shm/setup.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"
#include "dtrain/wire_stats.h"
#include "support/check.h"
#include "support/collective_matrix.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

CommunicatorOptions shm_options(size_t chunk_bytes = 1u << 20) {
  CommunicatorOptions o;
  o.transport = Transport::kSharedMemory;
  o.shm_chunk_bytes = chunk_bytes;
  return o;
}

void require_transport(const Communicator& c, const std::string& name) {
  DTRAIN_CHECK(c.transport_name() == name, "transport is {}, expected {}", c.transport_name(),
               name);
}

class ShmCollectives : public ::testing::TestWithParam<int> {};

// 64-byte buffers: every call takes many chunks, slices of a chunk are uneven or empty, and
// buffer sets alternate across calls.
TEST_P(ShmCollectives, TinyChunks) {
  run_ranks(
      GetParam(),
      [&](Communicator& c) {
        run_collective_matrix(c, "shared_memory", {1, 7, 33, 1001}, " (64 B chunks)");
      },
      shm_options(64));
}

// Random floats: each slice lines up with its place, the reduction runs in rank order
// (bit-identical to summing the ranks' tensors in order), and every rank gets the same bits.
TEST_P(ShmCollectives, RandomFloatsBitExactInRankOrder) {
  const int world = GetParam();
  run_ranks(
      world,
      [&](Communicator& c) {
        for (int64_t n : {int64_t{5}, int64_t{4099}, int64_t{300001}}) {
          auto input = [&](int r) {
            return at::sin(at::arange(n, at::kFloat) * (0.37f * static_cast<float>(r + 1))) *
                   100.0f;
          };
          at::Tensor want = input(0);
          for (int r = 1; r < world; ++r) want = want + input(r);
          at::Tensor t = input(c.rank());
          c.all_reduce(t)->wait();
          DTRAIN_CHECK(at::equal(t, want), "all_reduce n={} differs from the rank-order sum", n);
          at::Tensor all = at::empty({n * world});
          c.all_gather(all, t)->wait();
          for (int r = 0; r < world; ++r)
            DTRAIN_CHECK(at::equal(all.narrow(0, r * n, n), t), "rank {} got other bits", r);
        }
      },
      shm_options(4096));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmCollectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// --- Several hosts: shared memory inside each, Gloo between leaders ---

// Thread ranks that claim the host identities `hosts[rank]`.
void run_fake_hosts(const std::vector<std::string>& hosts,
                    const std::function<void(Communicator&)>& fn, const CommunicatorOptions& o) {
  auto store = make_memory_store();
  const int world = static_cast<int>(hosts.size());
  run_threads(world, [&](int r) {
    auto failure = std::make_shared<detail::StickyFailure>();
    auto wire = std::make_shared<detail::WireCounter>();
    auto t =
        detail::make_cpu_engine(store, r, world, o, failure, wire, hosts[static_cast<size_t>(r)]);
    detail::FrontEnd comm(r, world, o, failure, std::move(t), wire);
    fn(comm);
  });
}

class ShmHierarchical : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(ShmHierarchical, EveryOpDtypeAndSize) {
  CommunicatorOptions o = shm_options(256);  // several chunks per call
  o.transport = Transport::kAuto;
  if (GetParam().size() == 2) o.transport = Transport::kSharedMemory;  // one rank per host
  run_fake_hosts(
      GetParam(),
      [&](Communicator& c) {
        run_collective_matrix(c, "hierarchical", {0, 1, 7, 1001});
      },
      o);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShmHierarchical,
                         ::testing::Values(std::vector<std::string>{"A", "A", "B", "B"},
                                           std::vector<std::string>{"A", "B", "A", "B"},
                                           std::vector<std::string>{"A", "B"}),
                         [](const auto& info) {
                           std::string name;
                           for (const auto& h : info.param) name += h;
                           return name;
                         });

// Bytes on the wire across fake hosts A A B B (docs/communication.md, "Bytes on the wire"):
// what goes to a rank of another host counts as inter-host, the rest as intra-host.
struct HostWire {
  std::string transport;
  WireStats all_gather, all_reduce;
};

std::vector<HostWire> wire_on_hosts(const CommunicatorOptions& o, int64_t block, int64_t n) {
  const std::vector<std::string> hosts = {"A", "A", "B", "B"};
  std::vector<HostWire> out(hosts.size());
  run_fake_hosts(
      hosts,
      [&](Communicator& c) {
        HostWire& w = out[static_cast<size_t>(c.rank())];
        w.transport = c.transport_name();
        WireStats before = wire_stats(c);
        c.all_gather_sync(at::empty({4 * block}), at::ones({block}));
        w.all_gather = wire_stats(c).since(before);
        before = wire_stats(c);
        c.all_reduce_sync(at::ones({n}));
        w.all_reduce = wire_stats(c).since(before);
      },
      o);
  return out;
}

TEST(ShmHierarchicalWire, FlatGlooCountsRingNeighboursOnOtherHostsAsInterHost) {
  CommunicatorOptions o;
  o.transport = Transport::kGloo;
  const uint64_t h = sizeof(detail::CallHeader);
  const auto w = wire_on_hosts(o, 1000, 4096);
  for (size_t r = 0; r < w.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(w[r].transport, "gloo");
    EXPECT_TRUE(w[r].all_gather.counted);
    // The all-gather ring sends 3 blocks to rank + 1: 0 -> 1 and 2 -> 3 stay on a host,
    // 1 -> 2 and 3 -> 0 cross. The all-reduce ring sends to rank - 1: 0 -> 3 and 2 -> 1 cross.
    const bool gather_crosses = r % 2 == 1;
    EXPECT_EQ(w[r].all_gather.all_gather.inter_host, gather_crosses ? 3 * 4000u : 0u);
    EXPECT_EQ(w[r].all_gather.all_gather.intra_host, gather_crosses ? 0u : 3 * 4000u);
    const bool reduce_crosses = r % 2 == 0;
    EXPECT_EQ(w[r].all_reduce.all_reduce.inter_host, reduce_crosses ? 6 * 4096u : 0u);
    EXPECT_EQ(w[r].all_reduce.all_reduce.intra_host, reduce_crosses ? 0u : 6 * 4096u);
    // Headers go to all three peers: one on this host, two on the other.
    EXPECT_EQ(w[r].all_gather.control.intra_host, h);
    EXPECT_EQ(w[r].all_gather.control.inter_host, 2 * h);
  }
}

TEST(ShmHierarchicalWire, OnlyLeadersCrossHostsAndOnlyWithTheirHostsShare) {
  CommunicatorOptions o;  // kAuto: hierarchical on two hosts of two ranks
  const uint64_t h = sizeof(detail::CallHeader);
  const auto w = wire_on_hosts(o, 1000, 4096);
  for (size_t r = 0; r < w.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(w[r].transport, "hierarchical");
    const bool leader = r % 2 == 0;
    // Every rank writes its block into its host's segment; a leader then sends its host's two
    // blocks to the other leader and writes all four blocks back into the segment.
    EXPECT_EQ(w[r].all_gather.all_gather.intra_host, leader ? 4000u + 16000u : 4000u);
    EXPECT_EQ(w[r].all_gather.all_gather.inter_host, leader ? 8000u : 0u);
    // The leaders' ring all-reduce over two leaders sends half the buffer twice.
    EXPECT_EQ(w[r].all_reduce.all_reduce.inter_host, leader ? 4 * 4096u : 0u);
    EXPECT_GT(w[r].all_reduce.all_reduce.intra_host, 0u);
    // One header into the segment; a leader's also goes to the other leader.
    EXPECT_EQ(w[r].all_gather.control.intra_host, h);
    EXPECT_EQ(w[r].all_gather.control.inter_host, leader ? h : 0u);
  }
}

TEST(ShmHierarchicalSelection, UnevenHostsUseGlooOrAreRefused) {
  const std::vector<std::string> hosts = {"A", "A", "B"};
  run_fake_hosts(
      hosts, [&](Communicator& c) { require_transport(c, "gloo"); }, CommunicatorOptions{});
  run_fake_hosts(
      {"A", "B"}, [&](Communicator& c) { require_transport(c, "gloo"); }, CommunicatorOptions{});
  try {
    run_fake_hosts(
        hosts, [&](Communicator&) {}, shm_options());
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("needs the same number of ranks on every host"),
              std::string::npos)
        << e.what();
  }
}

// Rank 3 (host B) disagrees: host B raises DesyncError, its leader tells host A's leader,
// and host A fails at once, long before the 20 s timeout.
TEST(ShmHierarchicalSelection, DesyncOnOneHostFailsEveryHostAtOnce) {
  CommunicatorOptions o;
  o.timeout = std::chrono::milliseconds(20000);
  const auto start = std::chrono::steady_clock::now();
  run_fake_hosts(
      {"A", "A", "B", "B"},
      [&](Communicator& c) {
        at::Tensor t = at::ones({c.rank() == 3 ? 512 : 1024});
        try {
          c.all_reduce(t)->wait();
        } catch (const CommError&) {
          return;
        }
        DTRAIN_CHECK(false, "rank {}: no error", c.rank());
      },
      o);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

// --- Selection ---

TEST(ShmSelection, AutomaticOnOneHostForcedGlooAndBothWork) {
  for (Transport t : {Transport::kAuto, Transport::kGloo, Transport::kSharedMemory}) {
    CommunicatorOptions o;
    o.transport = t;
    run_ranks(
        2,
        [&](Communicator& c) {
          const std::string want = t == Transport::kGloo ? "gloo" : "shared_memory";
          DTRAIN_CHECK(c.transport_name() == want, "asked {}, got {}", to_string(t),
                       c.transport_name());
          DTRAIN_CHECK(c.backend() == Backend::kGloo, "backend");
          at::Tensor x = at::full({3}, static_cast<float>(c.rank() + 1));
          c.all_reduce(x)->wait();
          DTRAIN_CHECK(x[0].item<float>() == 3.0f, "sum");
          // Send/recv stay on Gloo, ordered after the collectives issued before them.
          at::Tensor p = at::full({4}, static_cast<float>(c.rank()));
          auto work = c.rank() == 0 ? c.send(p, 1, 5) : c.recv(p, 0, 5);
          work->wait();
          DTRAIN_CHECK(p[0].item<float>() == 0.0f, "recv");
        },
        o);
  }
}

TEST(ShmSelection, RanksAskingForDifferentTransportsAreRefusedOnEveryRank) {
  auto store = make_memory_store();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      CommunicatorOptions o;
      o.timeout = std::chrono::milliseconds(5000);
      o.transport = r == 0 ? Transport::kGloo : Transport::kSharedMemory;
      try {
        make_communicator(store, r, 2, o);
      } catch (const InvalidArgument& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 0 asks for transport gloo, rank 1 for shared_memory"), std::string::npos)
        << e;
  }
}

TEST(ShmSelection, LaunchInfoReadsDtrainTransport) {
  EXPECT_EQ(LaunchInfo::from_env({}).transport, Transport::kAuto);
  EXPECT_EQ(LaunchInfo::from_env({{"DTRAIN_TRANSPORT", "gloo"}}).transport, Transport::kGloo);
  EXPECT_EQ(LaunchInfo::from_env({{"DTRAIN_TRANSPORT", "shm"}}).transport,
            Transport::kSharedMemory);
  EXPECT_EQ(LaunchInfo::from_env({{"DTRAIN_TRANSPORT", "auto"}}).transport, Transport::kAuto);
  try {
    LaunchInfo::from_env({{"DTRAIN_TRANSPORT", "tcp"}});
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_TRANSPORT='tcp'"), std::string::npos) << e.what();
  }
  LaunchInfo info = LaunchInfo::from_env({{"DTRAIN_TRANSPORT", "gloo"}});
  EXPECT_EQ(info.communicator_options().transport, Transport::kGloo);
  CommunicatorOptions own;
  own.transport = Transport::kSharedMemory;  // the program's choice wins
  EXPECT_EQ(info.communicator_options(own).transport, Transport::kSharedMemory);
}

// --- Consistency and failures ---

TEST(ShmFailure, DifferentSizesGiveDesyncErrorOnEveryRank) {
  run_ranks(
      3,
      [&](Communicator& c) {
        at::Tensor t = at::ones({1024 >> c.rank()});
        try {
          c.all_reduce(t)->wait();
        } catch (const DesyncError& e) {
          const std::string m = e.what();
          DTRAIN_CHECK(m.find("rank 0 issued all_reduce #0 float32[1024] sum") != std::string::npos,
                       "{}", m);
          DTRAIN_CHECK(at::equal(t, at::ones_like(t)), "data moved after a desync");
          return;
        }
        DTRAIN_CHECK(false, "no DesyncError");
      },
      shm_options());
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// A failed send breaks rank 0's communicator: rank 1, waiting in a collective for it with a
// 20 s timeout, fails as soon as the send does.
TEST(ShmFailure, FailedSendMakesPeersInACollectiveFailAtOnce) {
  CommunicatorOptions o = shm_options();
  o.timeout = std::chrono::milliseconds(20000);
  run_ranks(
      2,
      [&](Communicator& c) {
        const auto start = std::chrono::steady_clock::now();
        try {
          if (c.rank() == 0) {
            CallOptions quick;
            quick.timeout = std::chrono::milliseconds(300);
            c.send(at::ones({4}), 1, 9, quick)->wait();  // nobody receives it
          } else {
            at::Tensor t = at::ones({16});
            c.all_reduce(t)->wait();
          }
          DTRAIN_CHECK(false, "rank {}: no error", c.rank());
        } catch (const CommError& e) {
          if (c.rank() == 1)
            DTRAIN_CHECK(std::string(e.what()).find("rank 0 failed") != std::string::npos, "{}",
                         e.what());
        }
        DTRAIN_CHECK(seconds_since(start) < 5.0, "rank {} took {} s", c.rank(),
                     seconds_since(start));
      },
      o);
}

// Entries of /dev/shm this process's segments would use ("dtrain-<uid>-<pid>-").
std::vector<std::string> own_segments(int pid = getpid()) {
  std::vector<std::string> out;
  const std::string prefix = fmt::format("dtrain-{}-{}-", getuid(), pid);
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) out.push_back(e->d_name);
    }
    closedir(d);
  }
  return out;
}

TEST(ShmSegment, NamesAreUnlinkedOnceEveryRankMappedThem) {
  const auto before = own_segments();
  run_ranks(
      3,
      [&](Communicator& c) {
        c.barrier()->wait();
        DTRAIN_CHECK(own_segments() == before, "a segment name is still in /dev/shm");
        at::Tensor t = at::ones({100});
        c.all_reduce(t)->wait();
      },
      shm_options());
  EXPECT_EQ(own_segments(), before);
}

// A crashed job's segment under the exact name the next job would use: never opened, never
// removed, and the new job gets a fresh name.
TEST(ShmSegment, StaleSegmentUnderTheSameNameIsNeverUsed) {
  const std::string stale = shm::segment_name("00000000deadbeef");
  const int fd = shm_open(stale.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << stale;
  ASSERT_EQ(ftruncate(fd, 1 << 16), 0);
  const char garbage[] = "left by a job that crashed";
  ASSERT_EQ(pwrite(fd, garbage, sizeof(garbage), 0), static_cast<ssize_t>(sizeof(garbage)));
  close(fd);
  try {
    shm::Segment::create(stale, 2, 4096);
    ADD_FAILURE() << "created over a stale segment";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("exists: a stale or foreign segment"), std::string::npos)
        << e.what();
  }
  try {
    shm::Segment::open(stale, 2);
    ADD_FAILURE() << "opened a foreign segment";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("not a dtrain segment"), std::string::npos) << e.what();
  }
  std::vector<std::string> ids = {"00000000deadbeef", "0000000000c0ffee"};
  size_t next = 0;
  {
    shm::Segment fresh = shm::create_unique_segment(2, 4096, [&] { return ids[next++]; });
    EXPECT_EQ(fresh.name(), shm::segment_name("0000000000c0ffee"));
    EXPECT_TRUE(shm::unlink_segment(fresh.name()));
  }
  // The stale one is untouched.
  const int again = shm_open(stale.c_str(), O_RDONLY, 0);
  ASSERT_GE(again, 0);
  char head[sizeof(garbage)] = {};
  EXPECT_EQ(pread(again, head, sizeof(head), 0), static_cast<ssize_t>(sizeof(head)));
  close(again);
  EXPECT_STREQ(head, garbage);
  EXPECT_TRUE(shm::unlink_segment(stale));
}

// --- Processes ---

std::vector<testing::Process> spawn_shm_job(int world, const std::string& scenario,
                                            int timeout_ms) {
  const int port = testing::free_port();
  std::vector<testing::Process> ps;
  for (int r = 0; r < world; ++r) {
    auto env = testing::rank_env(r, world, port);
    env["DTRAIN_TRANSPORT"] = "shm";
    ps.push_back(
        testing::spawn_process({DTRAIN_TEST_WORKER, scenario, std::to_string(timeout_ms)}, env));
  }
  return ps;
}

bool log_has(const std::string& path, const std::string& s) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str().find(s) != std::string::npos;
}

TEST(ShmProcesses, CollectivesAcrossProcesses) {
  auto ps = spawn_shm_job(3, "collectives", 20000);
  for (int r = 0; r < 3; ++r) {
    auto res = testing::wait_process(ps[static_cast<size_t>(r)], 90);
    EXPECT_EQ(res.exit_code, 0) << "rank " << r << ":\n" << res.output;
  }
}

// SIGKILL one rank mid-loop: the others fail from its pid's death, long before their 20 s
// timeout (the killed rank stays a zombie until we reap it, which must not look alive), and
// nothing of the job is left in /dev/shm.
TEST(ShmProcesses, KilledRankMakesTheOthersFailNamingIt) {
  const int timeout_ms = 20000;
  auto ps = spawn_shm_job(3, "loop", timeout_ms);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!(log_has(ps[0].log_path, "looping") && log_has(ps[1].log_path, "looping") &&
           log_has(ps[2].log_path, "looping"))) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "ranks never started looping";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(ps[1].pid, SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  for (int r : {0, 2}) {
    auto res = testing::wait_process(ps[static_cast<size_t>(r)], 30);
    EXPECT_EQ(res.exit_code, 3) << res.output;  // CommError
    EXPECT_NE(res.output.find(fmt::format("rank {}/3 all_reduce", r)), std::string::npos)
        << res.output;
    // Rank 0 sees rank 1 die; rank 2 may see that, or rank 0 failing first.
    EXPECT_TRUE(res.output.find("rank 1 (pid ") != std::string::npos ||
                res.output.find("rank 0 failed") != std::string::npos)
        << res.output;
  }
  EXPECT_LT(seconds_since(killed_at), 5.0);
  testing::wait_process(ps[1], 5);
  for (const auto& p : ps) EXPECT_TRUE(own_segments(p.pid).empty());
}

}  // namespace
}  // namespace dtrain

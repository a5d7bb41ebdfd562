// Launch environment parsing, and real multi-process runs over the TCP store: processes
// started with posix_spawn (exec), one of which is killed or never started.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

class ScopedEnv {
 public:
  ScopedEnv(std::map<std::string, std::string> vars) {
    for (const char* k :
         {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) {
      if (const char* v = getenv(k)) saved_[k] = v;
      unsetenv(k);
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const char* k :
         {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})
      unsetenv(k);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_;
};

TEST(LaunchInfo, DefaultsToOneProcess) {
  ScopedEnv env({});
  LaunchInfo i = LaunchInfo::from_env();
  EXPECT_EQ(i.rank, 0);
  EXPECT_EQ(i.world_size, 1);
  EXPECT_EQ(i.local_rank, 0);
  EXPECT_EQ(i.master_port, 29500);
}

TEST(LaunchInfo, ReadsTorchrunVariables) {
  ScopedEnv env({{"MASTER_ADDR", "10.0.0.1"},
                 {"MASTER_PORT", "1234"},
                 {"RANK", "5"},
                 {"WORLD_SIZE", "8"},
                 {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "4"}});
  LaunchInfo i = LaunchInfo::from_env();
  EXPECT_EQ(i.master_addr, "10.0.0.1");
  EXPECT_EQ(i.master_port, 1234);
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 4);
}

TEST(LaunchInfo, RejectsBadValuesNamingTheVariable) {
  auto message = [](std::map<std::string, std::string> vars) -> std::string {
    ScopedEnv env(std::move(vars));
    try {
      LaunchInfo::from_env();
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message({{"RANK", "abc"}}).find("RANK='abc'"), std::string::npos);
  EXPECT_NE(message({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2"), std::string::npos);
  EXPECT_NE(message({{"MASTER_PORT", "70000"}}).find("MASTER_PORT"), std::string::npos);
  EXPECT_NE(message({{"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0"), std::string::npos);
}

TEST(LaunchInfo, WorldOfOneNeedsNoNetwork) {
  LaunchInfo i;
  i.master_port = 1;  // nothing listens there; a world of one must not try
  auto c = init_communicator(i);
  at::Tensor t = at::ones({3});
  c->all_reduce(t)->wait();
  EXPECT_EQ(c->world_size(), 1);
}

std::vector<testing::Process> spawn_job(int world, int port, const std::string& scenario,
                                        int timeout_ms, int only_rank = -1) {
  std::vector<testing::Process> ps;
  for (int r = 0; r < world; ++r) {
    if (only_rank >= 0 && r != only_rank) continue;
    ps.push_back(testing::spawn_process({DTRAIN_TEST_WORKER, scenario, std::to_string(timeout_ms)},
                                        testing::rank_env(r, world, port)));
  }
  return ps;
}

TEST(MultiProcess, CollectivesOverTcpStore) {
  const int world = 3;
  auto ps = spawn_job(world, testing::free_port(), "collectives", 20000);
  for (int r = 0; r < world; ++r) {
    auto res = testing::wait_process(ps[r], 90);
    EXPECT_EQ(res.exit_code, 0) << "rank " << r << ":\n" << res.output;
  }
}

TEST(MultiProcess, KilledRankMakesSurvivorFailWithinTwiceTheTimeout) {
  const int timeout_ms = 2000;
  auto ps = spawn_job(2, testing::free_port(), "loop", timeout_ms);
  // Wait until both ranks are exchanging data, then kill rank 1.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  auto log_has = [](const std::string& path, const std::string& s) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str().find(s) != std::string::npos;
  };
  while (!(log_has(ps[0].log_path, "looping") && log_has(ps[1].log_path, "looping"))) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "ranks never started looping";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(ps[1].pid, SIGKILL);
  auto killed_at = std::chrono::steady_clock::now();
  auto survivor = testing::wait_process(ps[0], 30);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  testing::wait_process(ps[1], 5);
  // 3: dtrain::CommError (connection closed), 4: dtrain::TimeoutError; both are failures
  // surfaced to the caller, which is the contract.
  EXPECT_TRUE(survivor.exit_code == 3 || survivor.exit_code == 4) << survivor.output;
  EXPECT_LT(s, 2 * timeout_ms / 1000.0 + 1.0) << survivor.output;
  EXPECT_NE(survivor.output.find("rank 0/2"), std::string::npos) << survivor.output;
}

TEST(MultiProcess, RankThatNeverStartsMakesOthersTimeOut) {
  const int timeout_ms = 1500;
  auto start = std::chrono::steady_clock::now();
  auto ps = spawn_job(2, testing::free_port(), "collectives", timeout_ms, /*only_rank=*/0);
  auto res = testing::wait_process(ps[0], 30);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(res.exit_code, 4) << res.output;  // 4: caught dtrain::TimeoutError
  EXPECT_LT(s, 2 * timeout_ms / 1000.0 + 2.0) << res.output;
}

}  // namespace
}  // namespace dtrain

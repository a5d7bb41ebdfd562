// Rendezvous through an external etcd server (DTRAIN_RDZV_BACKEND=etcd): the launch
// variables, real multi-process jobs whose store is etcd, and the point of it: the store
// outlives rank 0, where the built-in TCP store ends with it.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>

#include "dtrain/errors.h"
#include "dtrain/etcd_store.h"
#include "dtrain/rendezvous.h"
#include "support/etcd_server.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using Env = std::map<std::string, std::string>;
using std::chrono::milliseconds;

// As rendezvous_test.cpp: a worker's start-up (loading LibTorch) on top of its timeouts.
double startup_slack_s() {
  const char* scale = std::getenv("DTRAIN_TEST_TIME_SCALE");
  return 2.0 * (scale != nullptr ? std::max(1.0, std::atof(scale)) : 1.0);
}

std::string from_env_error(const Env& env) {
  try {
    LaunchInfo::from_env(env);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(LaunchConventions, EtcdRendezvousVariables) {
  const Env base{{"RANK", "1"}, {"WORLD_SIZE", "2"}};
  LaunchInfo i = LaunchInfo::from_env(base);
  EXPECT_EQ(i.rdzv_backend, RendezvousBackend::kTcp);
  EXPECT_EQ(i.run_id, "none");
  EXPECT_EQ(i.generation, 0);

  Env env = base;
  env["DTRAIN_RDZV_BACKEND"] = "etcd";
  env["DTRAIN_RDZV_ENDPOINT"] = "etcd-a:2379,etcd-b:2379";
  env["TORCHELASTIC_RUN_ID"] = "job7";
  env["TORCHELASTIC_RESTART_COUNT"] = "2";
  i = LaunchInfo::from_env(env);
  EXPECT_EQ(i.rdzv_backend, RendezvousBackend::kEtcd);
  EXPECT_STREQ(to_string(i.rdzv_backend), "etcd");
  EXPECT_EQ(i.rdzv_endpoint, "etcd-a:2379,etcd-b:2379");
  EXPECT_EQ(i.run_id, "job7");
  EXPECT_EQ(i.generation, 2);  // a restart count where no generation is given
  env["DTRAIN_GENERATION"] = "5";
  EXPECT_EQ(LaunchInfo::from_env(env).generation, 5);
  env["DTRAIN_RDZV_BACKEND"] = "c10d";
  EXPECT_EQ(LaunchInfo::from_env(env).rdzv_backend, RendezvousBackend::kTcp);

  auto has = [](const std::string& e, const std::string& what) {
    return e.find(what) != std::string::npos;
  };
  Env bad = base;
  bad["DTRAIN_RDZV_BACKEND"] = "zookeeper";
  std::string e = from_env_error(bad);
  EXPECT_TRUE(has(e, "DTRAIN_RDZV_BACKEND='zookeeper'")) << e;
  bad["DTRAIN_RDZV_BACKEND"] = "etcd";
  e = from_env_error(bad);
  EXPECT_TRUE(has(e, "needs DTRAIN_RDZV_ENDPOINT")) << e;
  bad["DTRAIN_RDZV_ENDPOINT"] = "etcd-a";
  e = from_env_error(bad);
  EXPECT_TRUE(has(e, "DTRAIN_RDZV_ENDPOINT: etcd endpoint 'etcd-a'")) << e;
  bad["DTRAIN_RDZV_ENDPOINT"] = "etcd-a:2379";
  bad["DTRAIN_GENERATION"] = "-1";
  e = from_env_error(bad);
  EXPECT_TRUE(has(e, "DTRAIN_GENERATION=-1")) << e;

  LaunchInfo direct;  // set by a program rather than the environment
  direct.rdzv_backend = RendezvousBackend::kEtcd;
  EXPECT_THROW(direct.validate(), InvalidArgument);  // no endpoint
}

Env etcd_rank_env(int rank, int world, const testing::EtcdServer& etcd, const std::string& run) {
  // MASTER_PORT names a port nobody serves: the job can only meet through etcd.
  Env env = testing::rank_env(rank, world, testing::free_port());
  env["DTRAIN_RDZV_BACKEND"] = "etcd";
  env["DTRAIN_RDZV_ENDPOINT"] = etcd.endpoint();
  env["TORCHELASTIC_RUN_ID"] = run;
  return env;
}

std::vector<testing::Process> spawn_etcd_job(int world, const testing::EtcdServer& etcd,
                                             const std::string& run, const std::string& scenario,
                                             int timeout_ms) {
  std::vector<testing::Process> ps;
  for (int r = 0; r < world; ++r) {
    ps.push_back(testing::spawn_process({DTRAIN_TEST_WORKER, scenario, std::to_string(timeout_ms)},
                                        etcd_rank_env(r, world, etcd, run)));
  }
  return ps;
}

TEST(MultiProcess, CollectivesOverEtcd) {
  if (!testing::EtcdServer::installed()) GTEST_SKIP() << testing::EtcdServer::kMissing;
  testing::EtcdServer etcd;
  const int world = 3;
  auto ps = spawn_etcd_job(world, etcd, "collectives-run", "collectives", 20000);
  for (int r = 0; r < world; ++r) {
    auto res = testing::wait_process(ps[r], 90);
    EXPECT_EQ(res.exit_code, 0) << "rank " << r << ":\n" << res.output;
  }
  // The job's keys are in etcd, under its run id and generation.
  EtcdStoreOptions o;
  o.endpoints = etcd.endpoint();
  o.key_prefix = "/dtrain/collectives-run/0/";
  o.timeout = milliseconds(5000);
  EXPECT_EQ(make_etcd_store(o)->add("dtrain/launch/joined", 0), world);

  // The same run id and generation again: etcd still holds the finished run, and every rank
  // says so (instead of mixing with it) and names the way out.
  ps = spawn_etcd_job(world, etcd, "collectives-run", "collectives", 5000);
  for (int r = 0; r < world; ++r) {
    auto res = testing::wait_process(ps[r], 60);
    EXPECT_NE(res.exit_code, 0) << "rank " << r << ":\n" << res.output;
    EXPECT_NE(res.output.find("claimed twice"), std::string::npos) << res.output;
    EXPECT_NE(res.output.find("etcdctl del --prefix /dtrain/collectives-run/"), std::string::npos)
        << res.output;
  }
}

// Rank 0 publishes a key and exits (its host is gone); rank 1, in this process, still reads
// it and keeps using the store. With the built-in TCP store, served by rank 0, the same
// read fails.
void rank_zero_leaves(RendezvousBackend backend, const testing::EtcdServer* etcd) {
  const int port = testing::free_port();
  Env env0 =
      etcd != nullptr ? etcd_rank_env(0, 2, *etcd, "outlive") : testing::rank_env(0, 2, port);
  env0["MASTER_PORT"] = std::to_string(port);
  auto rank0 = testing::spawn_process({DTRAIN_TEST_WORKER, "store_set", "20000"}, env0);
  LaunchInfo info;
  info.rank = 1;
  info.world_size = 2;
  info.local_rank = 1;
  info.local_world_size = 2;
  info.master_port = port;
  info.rdzv_backend = backend;
  if (etcd != nullptr) {
    info.rdzv_endpoint = etcd->endpoint();
    info.run_id = "outlive";
  }
  auto store = connect_store(info, milliseconds(20000));
  store->set("from_rank/1", std::string("here"));  // rank 0 leaves once it sees this
  auto res = testing::wait_process(rank0, 60);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  if (backend == RendezvousBackend::kEtcd) {
    EXPECT_EQ(store->get_string("from_rank/0", milliseconds(2000)), "alive");
    store->set("from_rank/1", std::string("still here"));
    EXPECT_EQ(store->get_string("from_rank/1", milliseconds(2000)), "still here");
    EXPECT_EQ(store->add("dtrain/launch/joined", 0), 2);
  } else {
    EXPECT_THROW(store->get("from_rank/0", milliseconds(2000)), CommError);
  }
}

TEST(MultiProcess, EtcdStoreOutlivesRankZero) {
  if (!testing::EtcdServer::installed()) GTEST_SKIP() << testing::EtcdServer::kMissing;
  testing::EtcdServer etcd;
  rank_zero_leaves(RendezvousBackend::kEtcd, &etcd);
}

TEST(MultiProcess, TcpStoreEndsWithRankZero) { rank_zero_leaves(RendezvousBackend::kTcp, nullptr); }

TEST(MultiProcess, UnreachableEtcdTimesOutNamingIt) {
  const int port = testing::free_port();
  Env env = testing::rank_env(0, 2, testing::free_port());
  env["DTRAIN_RDZV_BACKEND"] = "etcd";
  env["DTRAIN_RDZV_ENDPOINT"] = "127.0.0.1:" + std::to_string(port);
  const auto start = std::chrono::steady_clock::now();
  auto res = testing::wait_process(
      testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", "1500"}, env), 30);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(res.exit_code, 4) << res.output;  // 4: caught dtrain::TimeoutError
  EXPECT_NE(res.output.find("etcd 127.0.0.1:" + std::to_string(port)), std::string::npos)
      << res.output;
  EXPECT_NE(res.output.find("unreachable"), std::string::npos) << res.output;
  EXPECT_LT(s, 2 * 1.5 + startup_slack_s()) << res.output;
}

}  // namespace
}  // namespace dtrain

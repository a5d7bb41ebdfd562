// Launch environment parsing, and real multi-process runs over the TCP store: processes
// started with posix_spawn (exec), one of which is killed or never started.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "comm/device_contract.h"
#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

// Seconds a worker process may take to start (load LibTorch) on top of its timeouts: 2 s, times
// DTRAIN_TEST_TIME_SCALE where a build is slower (scripts/sanitize.sh sets it for ASan).
double startup_slack_s() {
  const char* scale = std::getenv("DTRAIN_TEST_TIME_SCALE");
  return 2.0 * (scale != nullptr ? std::max(1.0, std::atof(scale)) : 1.0);
}

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

// ---- Launcher conventions (LaunchInfo::from_env on a given environment) -----------------

using Env = std::map<std::string, std::string>;

std::string from_env_error(const Env& env) {
  try {
    LaunchInfo::from_env(env);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(LaunchInfo, JoinTimeoutFromTheEnvironment) {
  EXPECT_FALSE(LaunchInfo::from_env(Env{}).join_timeout.has_value());
  EXPECT_FALSE(LaunchInfo::from_env(Env{{"DTRAIN_JOIN_TIMEOUT", ""}}).join_timeout.has_value());
  EXPECT_EQ(LaunchInfo::from_env(Env{{"DTRAIN_JOIN_TIMEOUT", "60"}}).join_timeout,
            std::chrono::milliseconds(60000));
  EXPECT_EQ(LaunchInfo::from_env(Env{{"DTRAIN_JOIN_TIMEOUT", "2.5"}}).join_timeout,
            std::chrono::milliseconds(2500));
  for (const char* bad : {"abc", "0", "-5", "10s", "1e9", "nan"}) {
    const std::string m = from_env_error({{"DTRAIN_JOIN_TIMEOUT", bad}});
    EXPECT_NE(m.find(fmt::format("DTRAIN_JOIN_TIMEOUT='{}'", bad)), std::string::npos) << m;
    EXPECT_NE(m.find("seconds"), std::string::npos) << m;
  }
}

// The device contract (LaunchInfo::cuda_device): the environment and the device count are
// injected, so every case runs without a GPU.
LaunchInfo launch_on_host(int local_rank, int local_world, std::optional<std::string> visible) {
  std::map<std::string, std::string> env = {{"RANK", std::to_string(local_rank)},
                                            {"WORLD_SIZE", std::to_string(local_world)},
                                            {"LOCAL_RANK", std::to_string(local_rank)},
                                            {"LOCAL_WORLD_SIZE", std::to_string(local_world)}};
  if (visible) env["CUDA_VISIBLE_DEVICES"] = *visible;
  return LaunchInfo::from_env(env);
}

std::string invalid_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument)";
}

TEST(DeviceContract, ReadsCudaVisibleDevicesEvenWhenEmpty) {
  EXPECT_FALSE(launch_on_host(0, 1, std::nullopt).cuda_visible_devices.has_value());
  EXPECT_EQ(launch_on_host(0, 1, "3").cuda_visible_devices, "3");
  EXPECT_EQ(launch_on_host(0, 1, "").cuda_visible_devices, "");
  EXPECT_TRUE(launch_on_host(0, 1, "3").narrowed_to_one_gpu());
  EXPECT_TRUE(launch_on_host(0, 1, "GPU-8a1c").narrowed_to_one_gpu());
  EXPECT_TRUE(launch_on_host(0, 1, "2,-1,3").narrowed_to_one_gpu());  // CUDA stops at -1
  EXPECT_FALSE(launch_on_host(0, 1, "2,3").narrowed_to_one_gpu());
  EXPECT_FALSE(launch_on_host(0, 1, "").narrowed_to_one_gpu());
  EXPECT_FALSE(launch_on_host(0, 1, std::nullopt).narrowed_to_one_gpu());
}

TEST(DeviceContract, LocalRankUnlessNarrowedToOneDevice) {
  for (Backend b : {Backend::kNccl, Backend::kGloo}) {
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(launch_on_host(r, 4, std::nullopt).cuda_device(4, b), r) << to_string(b);
      EXPECT_EQ(launch_on_host(r, 4, "0,1,2,3").cuda_device(8, b), r) << to_string(b);
      // Slurm's --gpus-per-task: each rank sees only its own GPU, as device 0.
      EXPECT_EQ(launch_on_host(r, 4, std::to_string(r)).cuda_device(1, b), 0) << to_string(b);
    }
  }
}

TEST(DeviceContract, NcclRefusesMoreRanksThanGpusNamingCountsAndRemedies) {
  // Every rank refuses, also local rank 0, whose device exists: otherwise it would wait in
  // NCCL's initialisation for peers that failed.
  for (int r = 0; r < 4; ++r) {
    const std::string msg =
        invalid_message([&] { launch_on_host(r, 4, std::nullopt).cuda_device(1, Backend::kNccl); });
    EXPECT_NE(msg.find("4 ranks on this host"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1 visible CUDA device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("CUDA_VISIBLE_DEVICES unset"), std::string::npos) << msg;
    EXPECT_NE(msg.find("NCCL cannot run two ranks on one GPU"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--nproc_per_node"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Gloo backend"), std::string::npos) << msg;
    EXPECT_NE(msg.find(fmt::format("rank {}/4", r)), std::string::npos) << msg;
  }
  const std::string msg =
      invalid_message([&] { launch_on_host(1, 3, "4,5").cuda_device(2, Backend::kNccl); });
  EXPECT_NE(msg.find("CUDA_VISIBLE_DEVICES='4,5'"), std::string::npos) << msg;
}

TEST(DeviceContract, GlooSharesGpusRoundRobin) {
  EXPECT_EQ(launch_on_host(0, 4, std::nullopt).cuda_device(1, Backend::kGloo), 0);
  EXPECT_EQ(launch_on_host(3, 4, std::nullopt).cuda_device(1, Backend::kGloo), 0);
  EXPECT_EQ(launch_on_host(3, 4, std::nullopt).cuda_device(2, Backend::kGloo), 1);
}

TEST(DeviceContract, NoVisibleDeviceIsInvalid) {
  for (Backend b : {Backend::kNccl, Backend::kGloo}) {
    const std::string msg = invalid_message([&] { launch_on_host(0, 1, "").cuda_device(0, b); });
    EXPECT_NE(msg.find("no CUDA device is visible"), std::string::npos) << msg;
    EXPECT_NE(msg.find("CUDA_VISIBLE_DEVICES=''"), std::string::npos) << msg;
  }
}

// init_communicator fills the NCCL device in by the same rule; on a machine without a GPU it
// refuses before any backend is built.
TEST(DeviceContract, CommunicatorOptionsFollowTheRule) {
  CommunicatorOptions gloo;
  EXPECT_EQ(launch_on_host(1, 2, std::nullopt).communicator_options(gloo).device_index, -1);
  CommunicatorOptions nccl;
  nccl.backend = Backend::kNccl;
  nccl.device_index = 5;  // the caller's choice wins
  EXPECT_EQ(launch_on_host(1, 2, std::nullopt).communicator_options(nccl).device_index, 5);
  nccl.device_index = -1;
  const int n = cuda_device_count();
  if (n >= 2) {
    EXPECT_EQ(launch_on_host(1, 2, std::nullopt).communicator_options(nccl).device_index, 1);
  } else {
    EXPECT_THROW(launch_on_host(1, 2, std::nullopt).communicator_options(nccl), InvalidArgument);
  }
}

TEST(DeviceContract, SharedGpuAcrossRanksIsFoundByUuid) {
  using detail::GpuClaim;
  const GpuClaim a{"GPU-aaaa", "node1", 0, 1};
  const GpuClaim b{"GPU-bbbb", "node1", 0, 1};
  EXPECT_EQ(detail::find_shared_gpu({a, b}), std::nullopt);
  EXPECT_EQ(detail::find_shared_gpu({a}), std::nullopt);
  // Two ranks narrowed to the same GPU (CUDA_VISIBLE_DEVICES=0 inherited by both).
  const GpuClaim a_again{"GPU-aaaa", "node1", 0, 1};
  const auto msg = detail::find_shared_gpu({b, a, a_again});
  ASSERT_TRUE(msg.has_value());
  EXPECT_NE(msg->find("ranks 1 and 2 would both use GPU GPU-aaaa on host node1"), std::string::npos)
      << *msg;
  EXPECT_NE(msg->find("sees 1 CUDA device"), std::string::npos) << *msg;
  EXPECT_NE(msg->find("Gloo backend"), std::string::npos) << *msg;
  // The claim travels through the store as text.
  const GpuClaim round = detail::parse_gpu_claim(detail::serialize(GpuClaim{"GPU-c", "h", 3, 8}));
  EXPECT_EQ(round.uuid, "GPU-c");
  EXPECT_EQ(round.host, "h");
  EXPECT_EQ(round.device, 3);
  EXPECT_EQ(round.device_count, 8);
  EXPECT_THROW(detail::parse_gpu_claim("GPU-c\nh"), std::invalid_argument);
}

TEST(LaunchConventions, EmptyEnvironmentIsOneProcess) {
  LaunchInfo i = LaunchInfo::from_env(Env{});
  EXPECT_EQ(i.source, LaunchSource::kNone);
  EXPECT_EQ(i.world_size, 1);
  EXPECT_EQ(i.master_addr, "127.0.0.1");
  EXPECT_EQ(i.master_port, 29500);
}

TEST(LaunchConventions, Torchrun) {
  LaunchInfo i = LaunchInfo::from_env(Env{{"RANK", "5"},
                                          {"WORLD_SIZE", "8"},
                                          {"LOCAL_RANK", "1"},
                                          {"LOCAL_WORLD_SIZE", "4"},
                                          {"MASTER_ADDR", "node0"},
                                          {"MASTER_PORT", "1234"},
                                          {"GLOO_SOCKET_IFNAME", "eth1"}});
  EXPECT_EQ(i.source, LaunchSource::kTorchrun);
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 4);
  EXPECT_EQ(i.master_addr, "node0");
  EXPECT_EQ(i.master_port, 1234);
  EXPECT_EQ(i.socket_interface, "eth1");
}

TEST(LaunchConventions, OpenMpi) {
  LaunchInfo i = LaunchInfo::from_env(Env{{"OMPI_COMM_WORLD_RANK", "3"},
                                          {"OMPI_COMM_WORLD_SIZE", "4"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                          {"MASTER_ADDR", "10.1.0.1"}});
  EXPECT_EQ(i.source, LaunchSource::kOpenMpi);
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_EQ(i.master_addr, "10.1.0.1");
  EXPECT_EQ(i.master_port, 29500);
  // One host: no MASTER_ADDR needed.
  LaunchInfo one = LaunchInfo::from_env(Env{{"OMPI_COMM_WORLD_RANK", "1"},
                                            {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(one.master_addr, "127.0.0.1");
}

TEST(LaunchConventions, OpenMpiAcrossHostsNeedsMasterAddr) {
  const std::string e = from_env_error(Env{{"OMPI_COMM_WORLD_RANK", "3"},
                                           {"OMPI_COMM_WORLD_SIZE", "4"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_NE(e.find("MASTER_ADDR is not set"), std::string::npos) << e;
  EXPECT_NE(e.find("mpirun -x MASTER_ADDR"), std::string::npos) << e;
}

TEST(LaunchConventions, Slurm) {
  LaunchInfo i = LaunchInfo::from_env(Env{{"SLURM_PROCID", "5"},
                                          {"SLURM_NTASKS", "10"},
                                          {"SLURM_LOCALID", "1"},
                                          {"SLURM_NODEID", "2"},
                                          {"SLURM_STEP_TASKS_PER_NODE", "4(x2),2"},
                                          {"SLURM_STEP_NODELIST", "gpu[07-09,12],login1"},
                                          {"SLURM_JOB_NODELIST", "other[1-4]"},
                                          {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(i.source, LaunchSource::kSlurm);
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 10);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);  // third host of "4,4,2"
  EXPECT_EQ(i.master_addr, "gpu07");
  EXPECT_EQ(i.master_port, 29500 + 456);
}

TEST(LaunchConventions, SlurmFallbacksAndOverrides) {
  // SLURM_NTASKS_PER_NODE when the step list is absent; the job's node list; explicit
  // MASTER_ADDR/MASTER_PORT win over the derived ones.
  LaunchInfo i = LaunchInfo::from_env(Env{{"SLURM_PROCID", "0"},
                                          {"SLURM_NTASKS", "4"},
                                          {"SLURM_LOCALID", "0"},
                                          {"SLURM_NTASKS_PER_NODE", "2"},
                                          {"SLURM_JOB_NODELIST", "rack1-n[3-4]-ib"}});
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_EQ(i.master_addr, "rack1-n3-ib");
  EXPECT_EQ(i.master_port, 29500);
  LaunchInfo j = LaunchInfo::from_env(Env{{"SLURM_PROCID", "0"},
                                          {"SLURM_NTASKS", "4"},
                                          {"SLURM_LOCALID", "0"},
                                          {"SLURM_TASKS_PER_NODE", "2(x2)"},
                                          {"SLURM_NODEID", "1"},
                                          {"SLURM_JOB_NODELIST", "n[1-2]"},
                                          {"MASTER_ADDR", "10.0.0.9"},
                                          {"MASTER_PORT", "4000"}});
  EXPECT_EQ(j.master_addr, "10.0.0.9");
  EXPECT_EQ(j.master_port, 4000);
}

TEST(LaunchConventions, PrecedenceTorchrunThenOpenMpiThenSlurm) {
  // dtrain-run inside an srun step: dtrain-run's RANK/WORLD_SIZE describe this process.
  Env env{{"RANK", "3"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "3"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"SLURM_PROCID", "0"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_LOCALID", "0"},
          {"SLURM_NTASKS_PER_NODE", "1"},
          {"SLURM_JOB_NODELIST", "n1"},
          {"OMPI_COMM_WORLD_RANK", "1"},
          {"OMPI_COMM_WORLD_SIZE", "2"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
          {"MASTER_ADDR", "n1"}};
  EXPECT_EQ(LaunchInfo::from_env(env).source, LaunchSource::kTorchrun);
  EXPECT_EQ(LaunchInfo::from_env(env).rank, 3);
  env.erase("RANK");
  env.erase("WORLD_SIZE");
  EXPECT_EQ(LaunchInfo::from_env(env).source, LaunchSource::kOpenMpi);
  EXPECT_EQ(LaunchInfo::from_env(env).rank, 1);
  env.erase("OMPI_COMM_WORLD_RANK");
  env.erase("OMPI_COMM_WORLD_SIZE");
  EXPECT_EQ(LaunchInfo::from_env(env).source, LaunchSource::kSlurm);
}

TEST(LaunchConventions, IncompleteOrInconsistentNamesTheVariables) {
  auto has = [](const std::string& e, const std::string& what) {
    return e.find(what) != std::string::npos;
  };
  std::string e = from_env_error(Env{{"RANK", "1"}});
  EXPECT_TRUE(has(e, "WORLD_SIZE is not")) << e;
  e = from_env_error(Env{{"WORLD_SIZE", "2"}});
  EXPECT_TRUE(has(e, "RANK is not")) << e;
  e = from_env_error(Env{{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  EXPECT_TRUE(has(e, "RANK=2 must be in [0, WORLD_SIZE=2)")) << e;
  e = from_env_error(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}});
  EXPECT_TRUE(has(e, "LOCAL_WORLD_SIZE=3")) << e;
  e = from_env_error(Env{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_TRUE(has(e, "OMPI_COMM_WORLD_LOCAL_RANK is not")) << e;
  e = from_env_error(Env{{"OMPI_COMM_WORLD_RANK", "2"},
                         {"OMPI_COMM_WORLD_SIZE", "2"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_TRUE(has(e, "OMPI_COMM_WORLD_RANK=2 must be in [0, OMPI_COMM_WORLD_SIZE=2)")) << e;
  e = from_env_error(Env{{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}});
  EXPECT_TRUE(has(e, "SLURM_NTASKS is not")) << e;
  e = from_env_error(Env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}});
  EXPECT_TRUE(has(e, "cannot tell how many ranks share this host")) << e;
  e = from_env_error(Env{{"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "4"},
                         {"SLURM_LOCALID", "2"},
                         {"SLURM_NTASKS_PER_NODE", "2"},
                         {"SLURM_JOB_NODELIST", "n1"}});
  EXPECT_TRUE(has(e, "SLURM_LOCALID=2 must be in [0, SLURM_NTASKS_PER_NODE=2)")) << e;
  e = from_env_error(Env{{"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "6"},
                         {"SLURM_LOCALID", "0"},
                         {"SLURM_STEP_TASKS_PER_NODE", "4,2"},
                         {"SLURM_JOB_NODELIST", "n[1-2]"}});
  EXPECT_TRUE(has(e, "SLURM_NODEID is not set")) << e;
  e = from_env_error(Env{{"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "2"},
                         {"SLURM_LOCALID", "0"},
                         {"SLURM_NTASKS_PER_NODE", "2(x"},
                         {"SLURM_JOB_NODELIST", "n1"}});
  EXPECT_TRUE(has(e, "SLURM_NTASKS_PER_NODE")) << e;
  e = from_env_error(Env{{"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "2"},
                         {"SLURM_LOCALID", "0"},
                         {"SLURM_NTASKS_PER_NODE", "2"},
                         {"SLURM_JOB_NODELIST", "n[1-"}});
  EXPECT_TRUE(has(e, "SLURM_JOB_NODELIST")) << e;
  e = from_env_error(Env{{"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "2"},
                         {"SLURM_LOCALID", "0"},
                         {"SLURM_NTASKS_PER_NODE", "2"}});
  EXPECT_TRUE(has(e, "SLURM_STEP_NODELIST")) << e;
  e = from_env_error(Env{{"GLOO_SOCKET_IFNAME", "eth0,eth1"}});
  EXPECT_TRUE(has(e, "GLOO_SOCKET_IFNAME='eth0,eth1'")) << e;
}

// ---- Listening address --------------------------------------------------------------------

TEST(ListenAddress, CommunicatorOptionsFromLaunch) {
  LaunchInfo i;
  i.socket_interface = "eth7";
  i.local_rank = 0;
  EXPECT_EQ(i.communicator_options().interface, "eth7");
  CommunicatorOptions mine;
  mine.interface = "ib0";
  EXPECT_EQ(i.communicator_options(mine).interface, "ib0");  // the caller's choice wins
  mine = {};
  mine.hostname = "10.0.0.5";
  EXPECT_EQ(i.communicator_options(mine).interface, "");  // an explicit address wins too
}

TEST(ListenAddress, NamedInterfaceIsUsedAndAMissingOneIsAClearError) {
  CommunicatorOptions o;
  o.interface = "lo";
  o.timeout = std::chrono::milliseconds(20000);
  testing::run_ranks(
      2,
      [](Communicator& c) {
        at::Tensor t = at::ones({4});
        c.all_reduce(t)->wait();
        if (t[0].item<float>() != 2) throw std::runtime_error("all_reduce over lo");
      },
      o);
  o.interface = "no-such-if0";
  try {
    make_communicator(make_memory_store(), 0, 1, o);
    FAIL() << "no error for a missing interface";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'no-such-if0' does not exist"), std::string::npos) << m;
    EXPECT_NE(m.find("lo"), std::string::npos) << m;  // lists the interfaces that exist
  }
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

// Two processes claiming rank 1 (two hosts with the same --node_rank): every process fails
// within the timeout, and the message names the launch mistake, not just a timeout.
TEST(MultiProcess, DuplicateRankFailsEveryRankWithTheCause) {
  const int timeout_ms = 15000;
  const int port = testing::free_port();
  auto start = std::chrono::steady_clock::now();
  std::vector<testing::Process> ps;
  ps.push_back(
      testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", std::to_string(timeout_ms)},
                             testing::rank_env(0, 3, port)));
  for (int k = 0; k < 2; ++k) {
    ps.push_back(
        testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", std::to_string(timeout_ms)},
                               testing::rank_env(1, 3, port)));
  }
  for (auto& p : ps) {
    auto res = testing::wait_process(p, 60);
    EXPECT_EQ(res.exit_code, 1) << res.output;  // 1: InvalidArgument, not a timeout
    EXPECT_NE(res.output.find("rank 1 is claimed twice"), std::string::npos) << res.output;
    EXPECT_NE(res.output.find("--node_rank"), std::string::npos) << res.output;
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, timeout_ms / 1000.0) << "the error must not wait out the timeout";
}

// Ranks started with different world sizes (different --nnodes / --nproc_per_node).
TEST(MultiProcess, WorldSizeMismatchFailsEveryRankWithTheCause) {
  const int timeout_ms = 15000;
  const int port = testing::free_port();
  std::vector<testing::Process> ps;
  ps.push_back(
      testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", std::to_string(timeout_ms)},
                             testing::rank_env(0, 2, port)));
  ps.push_back(
      testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", std::to_string(timeout_ms)},
                             testing::rank_env(1, 3, port)));
  for (auto& p : ps) {
    auto res = testing::wait_process(p, 60);
    EXPECT_EQ(res.exit_code, 1) << res.output;
    EXPECT_NE(res.output.find("disagree on the world size"), std::string::npos) << res.output;
  }
}

TEST(MultiProcess, PortTakenOnTheMasterIsNamed) {
  const int port = testing::free_port();
  TcpStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.is_server = true;
  so.timeout = std::chrono::milliseconds(5000);
  auto occupant = make_tcp_store(so);  // another server holds the port
  auto p = testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", "3000"},
                                  testing::rank_env(0, 2, port));
  auto res = testing::wait_process(p, 30);
  EXPECT_EQ(res.exit_code, 3) << res.output;  // CommError
  EXPECT_NE(res.output.find("rank 0/2"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("is it taken?"), std::string::npos) << res.output;
}

TEST(MultiProcess, UnreachableMasterTimesOutNamingIt) {
  const int port = testing::free_port();
  auto start = std::chrono::steady_clock::now();
  auto p = testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", "1500"},
                                  testing::rank_env(1, 2, port));  // rank 0 never starts
  auto res = testing::wait_process(p, 30);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(res.exit_code, 4) << res.output;
  EXPECT_NE(res.output.find("rank 1/2"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("unreachable"), std::string::npos) << res.output;
  EXPECT_LT(s, 2 * 1.5 + startup_slack_s()) << res.output;
}

// A wrong MASTER_PORT (nothing serves it): DTRAIN_JOIN_TIMEOUT bounds the wait whatever the
// program's timeout (60 s here), and the rank says what it waits for while it waits.
TEST(MultiProcess, JoinTimeoutFromEnvironmentAndProgressLinesWhileWaitingForTheMaster) {
  const int port = testing::free_port();
  auto env = testing::rank_env(1, 2, port);
  env["DTRAIN_JOIN_TIMEOUT"] = "3.5";
  auto start = std::chrono::steady_clock::now();
  auto p = testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", "60000"}, env);
  auto res = testing::wait_process(p, 60);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(res.exit_code, 4) << res.output;  // TimeoutError
  EXPECT_LT(s, 3.5 + startup_slack_s()) << res.output;
  EXPECT_NE(res.output.find("unreachable"), std::string::npos) << res.output;
  const std::string line = fmt::format(
      "dtrain: rank 1 of 2 waiting for the master (rank 0's store) at 127.0.0.1:{}, 1 s of 3.5 s",
      port);
  EXPECT_NE(res.output.find(line), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("DTRAIN_JOIN_TIMEOUT"), std::string::npos) << res.output;
}

// A rank that never starts: rank 0 names it while waiting and in the timeout's message.
TEST(MultiProcess, JoinProgressLinesNameTheRanksThatNeverStarted) {
  const int port = testing::free_port();
  auto env = testing::rank_env(0, 3, port);
  env["DTRAIN_JOIN_TIMEOUT"] = "3";
  std::vector<testing::Process> ps;
  ps.push_back(testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", "60000"}, env));
  auto env1 = testing::rank_env(1, 3, port);
  env1["DTRAIN_JOIN_TIMEOUT"] = "3";
  ps.push_back(testing::spawn_process({DTRAIN_TEST_WORKER, "collectives", "60000"}, env1));
  auto start = std::chrono::steady_clock::now();
  auto res = testing::wait_process(ps[0], 60);
  testing::wait_process(ps[1], 60);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(res.exit_code, 4) << res.output;
  EXPECT_LT(s, 3 + startup_slack_s()) << res.output;
  EXPECT_NE(res.output.find(fmt::format("dtrain: rank 0 of 3 waiting for 1 of 3 ranks (rank 2 not "
                                        "started or not reaching the store) at 127.0.0.1:{}",
                                        port)),
            std::string::npos)
      << res.output;
  EXPECT_NE(res.output.find("only 2 of 3 ranks joined"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("(rank 2 not started"), std::string::npos) << res.output;
}

TEST(MultiProcess, RankThatNeverStartsMakesOthersTimeOut) {
  const int timeout_ms = 1500;
  auto start = std::chrono::steady_clock::now();
  auto ps = spawn_job(2, testing::free_port(), "collectives", timeout_ms, /*only_rank=*/0);
  auto res = testing::wait_process(ps[0], 30);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(res.exit_code, 4) << res.output;  // 4: caught dtrain::TimeoutError
  EXPECT_LT(s, 2 * timeout_ms / 1000.0 + startup_slack_s()) << res.output;
}

}  // namespace
}  // namespace dtrain

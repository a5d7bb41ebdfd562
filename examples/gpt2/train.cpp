// gpt2_train: trains GPT-2 with one loop for every strategy (single device, DDP, FSDP) and
// writes the metrics the single/DDP/FSDP comparison reports. See docs/gpt2.md.
//
//   gpt2_train --strategy single --batch 8
//   gpt2_train --strategy ddp --nproc 2 --batch 4          # starts its two ranks itself
//   dtrain-run --nproc_per_node 2 -- gpt2_train --strategy fsdp --batch 4
//
// main: flags (flags.cpp) -> Config; with --nproc N, start N ranks of this program; else
// maybe restart once for the BLAS kernel, then run this rank's Trainer (trainer.h).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "blas_setup.h"
#include "dtrain/errors.h"
#include "dtrain/host_memory.h"
#include "dtrain/launcher.h"
#include "dtrain/rendezvous.h"
#include "flags.h"
#include "trainer.h"

namespace gpt2 {
namespace {

// Variables that take effect only when a process starts: the BLAS plan's (OpenBLAS chose its
// kernels when it was loaded) and, with --malloc_tuning, glibc's huge-page tunable
// (dtrain/host_memory.h). Neither overrides what the user set.
std::map<std::string, std::string> start_environment(const Config& c, const BlasSetup& blas) {
  std::map<std::string, std::string> env = blas.plan.environment;
  if (c.malloc_tuning) {
    env.merge(dtrain::host_memory_environment(dtrain::host_memory_environment_from_env()));
  }
  return env;
}

// Restarts this process with `env` added: exec keeps the pid (a launcher supervising this
// rank sees no difference) and the arguments, and the variables it adds (DTRAIN_BLAS_CHOICE,
// GLIBC_TUNABLES) prevent a second restart. Returns only when exec fails.
void restart_with(BlasSetup& blas, const std::map<std::string, std::string>& env_added,
                  char** argv) {
  if (blas.plan.action == dtrain::BlasKernelPlan::Action::kSelect) {
    fmt::print("blas: {}; restarting with it (--blas_kernel keep: run as loaded)\n",
               blas.plan.note);
  }
  std::fflush(stdout);
  std::vector<std::string> env = dtrain::launcher::environment_with(env_added);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  execve("/proc/self/exe", argv, envp.data());
  const std::string failure = fmt::format("restarting failed: {}", std::strerror(errno));
  if (blas.plan.action == dtrain::BlasKernelPlan::Action::kSelect) {
    blas.plan.note =
        blas.info.to_string() + fmt::format(" ({} with {})", failure, blas.plan.kernel);
  }
  fmt::print(stderr, "gpt2_train: {}; running as started\n", failure);
}

// Parent of --nproc N: starts N copies of this program as the ranks and supervises them.
// The ranks' environment gets start_environment()'s variables.
int launch_self(const Config& c, int argc, char** argv, const dtrain::BlasKernelPlan& blas,
                std::map<std::string, std::string> environment) {
  dtrain::launcher::NodeOptions o;
  o.name = "gpt2_train";
  o.environment = std::move(environment);
  if (blas.action == dtrain::BlasKernelPlan::Action::kSelect) {
    fmt::print("blas: {}; the ranks start with it\n", blas.note);
    std::fflush(stdout);
  }
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  o.argv.push_back(ec ? std::string(argv[0]) : self.string());
  for (int i = 1; i < argc; ++i) o.argv.emplace_back(argv[i]);
  o.nproc_per_node = c.nproc;
  // With checkpoints, a forwarded SIGTERM/SIGINT is answered by a checkpoint write: give the
  // ranks time for it before SIGKILL (dtrain-run: --grace_s).
  if (!c.ckpt_dir.empty()) {
    o.grace = std::max<std::chrono::milliseconds>(o.grace, std::chrono::seconds(300));
  }
  if (const char* port = std::getenv("MASTER_PORT"); port != nullptr && *port != '\0') {
    o.master_port = std::atoi(port);
  }
  return dtrain::launcher::run_node(o);
}

}  // namespace
}  // namespace gpt2

int main(int argc, char** argv) {
  const std::vector<char*> rest = gpt2::parse_command_line(argc, argv);
  const char* rank_env = std::getenv("RANK");
  const bool launched = rank_env != nullptr && *rank_env != '\0';
  int rank = 0;
  try {
    if (rest.size() > 1) {
      throw dtrain::InvalidArgument(fmt::format("unexpected argument '{}'", rest[1]));
    }
    gpt2::Config config = gpt2::config_from_flags();
    gpt2::BlasSetup blas = gpt2::blas_setup(config.blas_kernel);
    const auto start_env = gpt2::start_environment(config, blas);
    if (!launched && config.nproc > 1) {
      return gpt2::launch_self(config, argc, argv, blas.plan, start_env);
    }
    if (!start_env.empty()) gpt2::restart_with(blas, start_env, argv);
    const dtrain::LaunchInfo info = dtrain::LaunchInfo::from_env();
    rank = info.rank;
    gpt2::Trainer(std::move(config), info, std::move(blas)).run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "rank {}: {}\n", rank, e.what());
    return 1;
  }
  return 0;
}

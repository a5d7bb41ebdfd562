#include "bench_common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <absl/flags/flag.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "dtrain/errors.h"
#include "dtrain/launcher.h"
#include "dtrain/rendezvous.h"
#include "dtrain_cli/flags.h"

ABSL_FLAG(int64_t, nproc, 2,
          "ranks (processes) to run on this host; ignored when started by a launcher (RANK, "
          "or mpirun's OMPI_COMM_WORLD_RANK, set)");
ABSL_FLAG(std::string, backend, "gloo",
          "gloo (with --transport) or mpi (Backend::kMpi: start the program under mpirun)");
ABSL_FLAG(double, timeout_s, 120, "communicator timeout (connect and each call), seconds");
ABSL_FLAG(int64_t, gloo_segment_bytes,
          static_cast<int64_t>(dtrain::CommunicatorOptions{}.gloo_max_segment_bytes),
          "CommunicatorOptions::gloo_max_segment_bytes (all-reduce pipelining piece)");
ABSL_FLAG(std::string, transport, "auto",
          "CommunicatorOptions::transport: auto (shared memory on one host), gloo or shm");
ABSL_FLAG(int64_t, shm_chunk_bytes,
          static_cast<int64_t>(dtrain::CommunicatorOptions{}.shm_chunk_bytes),
          "CommunicatorOptions::shm_chunk_bytes");
ABSL_FLAG(std::string, gloo_iface, "",
          "CommunicatorOptions::interface (empty: GLOO_SOCKET_IFNAME, else the interface that "
          "routes to MASTER_ADDR)");

namespace dtrain::bench {
namespace {

std::atomic<bool> g_failed{false};
std::atomic<bool> g_comm_broken{false};

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// The program's file name, for messages (the ranks run it by its full path).
std::string program_name(const char* argv0) {
  const std::string path = argv0;
  return path.substr(path.find_last_of('/') + 1);
}

// --help: this program's flags, then Google Benchmark's (which exits).
void print_help() {
  std::printf("%s\nGoogle Benchmark flags follow.\n\n", cli::flags_help().c_str());
  benchmark::PrintDefaultHelp();
}

// The ranks of this host: N copies of this program under dtrain's launcher.
int launch_ranks(int argc, char** argv) {
  const int64_t nproc = absl::GetFlag(FLAGS_nproc);
  if (nproc < 1 || nproc > 64) {
    std::fprintf(stderr, "--nproc=%lld must be in [1, 64]\n", static_cast<long long>(nproc));
    return 2;
  }
  launcher::NodeOptions node;
  node.argv = launcher::self_command(argc, argv);
  node.nproc_per_node = static_cast<int>(nproc);
  node.name = program_name(argv[0]);
  node.environment = {{"OMP_NUM_THREADS", "1"}};
  try {
    return launcher::run_node(node);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: launching ranks failed: %s\n", node.name.c_str(), e.what());
    return 1;
  }
}

CommunicatorOptions communicator_options() {
  CommunicatorOptions options;
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "mpi") {
    options.backend = Backend::kMpi;
  } else if (backend != "gloo") {
    throw std::invalid_argument("--backend=" + backend + ": expected gloo or mpi");
  }
  options.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout_s) * 1000));
  options.gloo_max_segment_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_gloo_segment_bytes));
  options.interface = absl::GetFlag(FLAGS_gloo_iface);
  options.name = "bench";
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport == "gloo") {
    options.transport = Transport::kGloo;
  } else if (transport == "shm" || transport == "shared_memory") {
    options.transport = Transport::kSharedMemory;
  } else if (transport != "auto") {
    throw std::invalid_argument("--transport=" + transport + ": expected auto, gloo or shm");
  }
  options.shm_chunk_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_shm_chunk_bytes));
  return options;
}

}  // namespace

std::vector<int64_t> parse_int_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(std::stoll(item, nullptr, 0));
  }
  return out;
}

std::string format_bytes(int64_t bytes) {
  if (bytes >= (1 << 30) && bytes % (1 << 30) == 0) return std::to_string(bytes >> 30) + "GiB";
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + "MiB";
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return std::to_string(bytes >> 10) + "KiB";
  return std::to_string(bytes) + "B";
}

int64_t iterations_for(int64_t bytes, int64_t target_bytes, int64_t min_iters, int64_t max_iters) {
  // max_iters wins over min_iters: a smoke run asks for few iterations.
  const int64_t hi = std::max<int64_t>(1, max_iters);
  const int64_t lo = std::clamp<int64_t>(min_iters, 1, hi);
  const int64_t n = bytes > 0 ? target_bytes / bytes : hi;
  return std::clamp(n, lo, hi);
}

void fail(benchmark::State& state, const Communicator& comm, const std::string& name,
          const std::string& message, bool comm_broken) {
  g_failed = true;
  if (comm_broken) g_comm_broken = true;
  std::fprintf(stderr, "[rank %d] %s: FAILED: %s\n", comm.rank(), name.c_str(), message.c_str());
  state.SkipWithError(message.c_str());
}

bool skip_after_comm_failure(benchmark::State& state) {
  if (!g_comm_broken) return false;
  state.SkipWithError("not run: a communication failure happened earlier");
  return true;
}

benchmark::internal::Benchmark* register_benchmark(const std::string& name,
                                                   const Communicator& comm,
                                                   std::function<void(benchmark::State&)> body) {
  return benchmark::RegisterBenchmark(
      name.c_str(), [&comm, name, body = std::move(body)](benchmark::State& state) {
        if (skip_after_comm_failure(state)) return;
        try {
          body(state);
        } catch (const std::exception& e) {
          fail(state, comm, name, e.what(), /*comm_broken=*/true);
        }
      });
}

bool all_ranks_ok(Communicator& comm, bool ok, std::string* failed_ranks) {
  at::Tensor flags = at::zeros({comm.world_size()}, at::kInt);
  flags[comm.rank()] = ok ? 0 : 1;
  comm.all_reduce(flags)->wait();
  bool all = true;
  std::string list;
  auto acc = flags.accessor<int, 1>();
  for (int r = 0; r < comm.world_size(); ++r) {
    if (acc[r] != 0) {
      all = false;
      list += (list.empty() ? "" : ",") + std::to_string(r);
    }
  }
  if (failed_ranks != nullptr) *failed_ranks = list;
  return all;
}

int bench_main(int argc, char** argv,
               const std::function<void(Communicator&)>& register_benchmarks) {
  // A rank of dtrain-run (or torchrun) or of mpirun; otherwise this process starts the ranks.
  const char* rank_env = std::getenv("RANK");
  if (rank_env == nullptr || *rank_env == '\0') rank_env = std::getenv("OMPI_COMM_WORLD_RANK");
  const bool is_rank = rank_env != nullptr && *rank_env != '\0';
  const std::vector<std::string> command(argv, argv + argc);  // before parsing edits argv
  // Only rank 0 writes the output file (Google Benchmark also reads its flags from the
  // environment).
  if (is_rank && std::string(rank_env) != "0") {
    int kept = 1;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (starts_with(a, "--benchmark_out=") || starts_with(a, "--benchmark_out_format=")) continue;
      argv[kept++] = argv[i];
    }
    argc = kept;
    argv[argc] = nullptr;
    unsetenv("BENCHMARK_OUT");
    unsetenv("BENCHMARK_OUT_FORMAT");
  }
  const std::string program = program_name(argv[0]);
  benchmark::Initialize(&argc, argv, print_help);  // takes its --benchmark_* flags out of argv
  try {
    cli::parse_flags(std::vector<std::string>(argv, argv + argc), 1, cli::Positional::kReject);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s (--help lists the flags)\n", program.c_str(), e.what());
    return 2;
  }
  if (!is_rank) {
    std::vector<char*> args;
    for (const auto& a : command) args.push_back(const_cast<char*>(a.c_str()));
    return launch_ranks(static_cast<int>(args.size()), args.data());
  }

  // One intra-op thread per rank: several ranks share this host's cores.
  at::set_num_threads(1);
  bool ok = true;
  LaunchInfo info;
  try {
    info = LaunchInfo::from_env();
    const CommunicatorOptions options = communicator_options();
    CommunicatorPtr comm = init_communicator(info, options);
    if (info.rank == 0) {
      const std::string iface = info.communicator_options(options).interface;
      const std::string net = iface.empty() ? "TCP to " + info.master_addr : iface;
      const std::string transport = comm->transport_name();
      const std::string how = transport == "gloo" ? "Gloo over " + net
                              : transport == "mpi"
                                  ? std::string("MPI")
                                  : transport + " (send/recv: Gloo over " + net + ")";
      std::fprintf(stderr, "%s: %d ranks (processes), %s, %d intra-op thread(s)\n", program.c_str(),
                   info.world_size, how.c_str(), at::get_num_threads());
    }
    benchmark::AddCustomContext("transport", comm->transport_name());
    register_benchmarks(*comm);
    if (info.rank == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      NullReporter silent;
      benchmark::RunSpecifiedBenchmarks(&silent);
    }
    // Rank 0's report is out before any rank exits: a rank that fails makes the launcher
    // stop the others.
    std::cout.flush();
    std::fflush(stdout);
    // Nobody closes its connections while a peer still finishes the last collective.
    if (!g_comm_broken) comm->barrier()->wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] %s: %s\n", info.rank, program.c_str(), e.what());
    ok = false;
  }
  benchmark::Shutdown();
  if (g_failed) ok = false;
  if (!ok && info.rank == 0) std::fprintf(stderr, "%s: FAILED\n", program.c_str());
  return ok ? 0 : 1;
}

}  // namespace dtrain::bench

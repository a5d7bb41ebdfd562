#include "bench_common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"
#include "launcher/local_ranks.h"

namespace dtrain::bench {
namespace {

std::atomic<bool> g_failed{false};
std::atomic<bool> g_comm_broken{false};

// Set in the environment of the ranks this program spawns: the launcher's pid.
constexpr const char* kParentEnv = "DTRAIN_BENCH_PARENT";

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

using launcher::free_port;

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// The ranks 1..N-1 this process spawned. The destructor kills those still running, so
// that an early failure of rank 0 leaves no orphans.
class Children {
 public:
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    for (auto& c : children_) {
      if (c.pid > 0) {
        kill(c.pid, SIGKILL);
        waitpid(c.pid, nullptr, 0);
        std::remove(c.log.c_str());
      }
    }
  }

  void spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
             int rank) {
    Child c;
    c.rank = rank;
    c.log =
        "/tmp/dtrain_bench_" + std::to_string(getpid()) + "_rank" + std::to_string(rank) + ".log";
    // Google Benchmark also reads its flags from the environment; only rank 0 writes files.
    c.pid = launcher::spawn_process(
        "/proc/self/exe", args,
        launcher::environment_with(env, {"BENCHMARK_OUT", "BENCHMARK_OUT_FORMAT"}), "/dev/null",
        c.log);
    children_.push_back(c);
  }

  // Waits up to timeout_s for every child; kills the rest. Prints the log of each child
  // that failed. Returns true iff all exited with status 0.
  bool wait_all(double timeout_s) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    bool all_ok = true;
    for (auto& c : children_) {
      int status = 0;
      for (;;) {
        pid_t w = waitpid(c.pid, &status, WNOHANG);
        if (w == c.pid) break;
        if (std::chrono::steady_clock::now() > deadline) {
          std::fprintf(stderr, "rank %d did not exit within %.0f s; killing it\n", c.rank,
                       timeout_s);
          kill(c.pid, SIGKILL);
          waitpid(c.pid, &status, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      c.pid = -1;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok) {
        all_ok = false;
        if (WIFSIGNALED(status)) {
          std::fprintf(stderr, "rank %d was killed by signal %d; its stderr:\n", c.rank,
                       WTERMSIG(status));
        } else {
          std::fprintf(stderr, "rank %d exited with status %d; its stderr:\n", c.rank,
                       WEXITSTATUS(status));
        }
        std::ifstream in(c.log);
        std::stringstream ss;
        ss << in.rdbuf();
        std::string text = ss.str();
        if (text.size() > 8192) text = "...\n" + text.substr(text.size() - 8192);
        std::fprintf(stderr, "%s\n", text.c_str());
      }
      std::remove(c.log.c_str());
    }
    return all_ok;
  }

 private:
  struct Child {
    int rank = -1;
    pid_t pid = -1;
    std::string log;
  };
  std::vector<Child> children_;
};

}  // namespace

void Flags::add(const std::string& name, int64_t* value, const std::string& help) {
  flags_.push_back({name, help,
                    [name, value](const std::string& v) {
                      size_t pos = 0;
                      *value = std::stoll(v, &pos, 0);
                      if (pos != v.size()) throw std::invalid_argument("--" + name + "=" + v);
                    },
                    std::to_string(*value)});
}

void Flags::add(const std::string& name, double* value, const std::string& help) {
  std::ostringstream cur;
  cur << *value;
  flags_.push_back({name, help,
                    [name, value](const std::string& v) {
                      size_t pos = 0;
                      *value = std::stod(v, &pos);
                      if (pos != v.size()) throw std::invalid_argument("--" + name + "=" + v);
                    },
                    cur.str()});
}

void Flags::add(const std::string& name, std::string* value, const std::string& help) {
  flags_.push_back({name, help, [value](const std::string& v) { *value = v; }, *value});
}

void Flags::parse(int* argc, char** argv) {
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string arg = argv[i];
    bool taken = false;
    for (auto& f : flags_) {
      const std::string key = "--" + f.name;
      if (starts_with(arg, key + "=")) {
        try {
          f.set(arg.substr(key.size() + 1));
        } catch (const std::exception&) {
          throw std::invalid_argument("malformed flag " + arg);
        }
        taken = true;
      } else if (arg == key) {
        if (i + 1 >= *argc) throw std::invalid_argument("flag " + arg + " needs a value");
        try {
          f.set(argv[++i]);
        } catch (const std::exception&) {
          throw std::invalid_argument("malformed flag " + arg + " " + argv[i]);
        }
        taken = true;
      }
      if (taken) break;
    }
    if (!taken) argv[out++] = argv[i];
  }
  *argc = out;
  argv[out] = nullptr;
}

void Flags::print_help(const char* program) const {
  std::printf("%s flags:\n", program);
  for (const auto& f : flags_) {
    std::printf("  --%s=<value>  (default %s)\n      %s\n", f.name.c_str(), f.current.c_str(),
                f.help.c_str());
  }
  std::printf("\nGoogle Benchmark flags follow.\n\n");
}

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

int bench_main(int argc, char** argv, Flags& flags,
               const std::function<void(Communicator&)>& register_benchmarks) {
  int64_t nproc = 2;
  double timeout_s = 120;
  int64_t segment_bytes = static_cast<int64_t>(CommunicatorOptions{}.gloo_max_segment_bytes);
  std::string iface;
  std::string transport = "auto";
  int64_t shm_chunk_bytes = static_cast<int64_t>(CommunicatorOptions{}.shm_chunk_bytes);
  flags.add("nproc", &nproc,
            "ranks (processes) to run on this host; ignored when started by a launcher (RANK "
            "set)");
  flags.add("timeout_s", &timeout_s, "communicator timeout (connect and each call), seconds");
  flags.add("gloo_segment_bytes", &segment_bytes,
            "CommunicatorOptions::gloo_max_segment_bytes (all-reduce pipelining piece)");
  flags.add("transport", &transport,
            "CommunicatorOptions::transport: auto (shared memory on one host), gloo or shm");
  flags.add("shm_chunk_bytes", &shm_chunk_bytes, "CommunicatorOptions::shm_chunk_bytes");
  flags.add("gloo_iface", &iface, "CommunicatorOptions::interface (empty: GLOO_SOCKET_IFNAME, else the interface that routes to MASTER_ADDR)");

  // One intra-op thread per rank: several ranks share this host's cores.
  at::set_num_threads(1);

  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0) flags.print_help(argv[0]);
  }
  // The spawned ranks get the same flags, less the output file that only rank 0 writes.
  std::vector<std::string> child_args;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (starts_with(a, "--benchmark_out=") || starts_with(a, "--benchmark_out_format=")) continue;
    child_args.push_back(a);
  }
  try {
    flags.parse(&argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  const char* parent = std::getenv(kParentEnv);
  if (parent != nullptr) {
    // Spawned by a launcher that may die: do not outlive it.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (std::to_string(getppid()) != parent) return 1;
  }

  Children children;
  LaunchInfo info;
  try {
    if (std::getenv("RANK") != nullptr) {
      info = LaunchInfo::from_env();
    } else {
      if (nproc < 1 || nproc > 64) {
        std::fprintf(stderr, "--nproc=%lld must be in [1, 64]\n", static_cast<long long>(nproc));
        return 2;
      }
      info.master_addr = "127.0.0.1";
      info.master_port = free_port();
      info.world_size = info.local_world_size = static_cast<int>(nproc);
      info.rank = info.local_rank = 0;
      for (int r = 1; r < nproc; ++r) {
        const std::string rs = std::to_string(r), ws = std::to_string(nproc);
        children.spawn(child_args,
                       {{"MASTER_ADDR", info.master_addr},
                        {"MASTER_PORT", std::to_string(info.master_port)},
                        {"RANK", rs},
                        {"WORLD_SIZE", ws},
                        {"LOCAL_RANK", rs},
                        {"LOCAL_WORLD_SIZE", ws},
                        {"OMP_NUM_THREADS", "1"},
                        {kParentEnv, std::to_string(getpid())}},
                       r);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: launching ranks failed: %s\n", argv[0], e.what());
    return 1;
  }

  bool ok = true;
  try {
    CommunicatorOptions options;
    options.backend = Backend::kGloo;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    options.gloo_max_segment_bytes = static_cast<size_t>(segment_bytes);
    options.interface = iface;
    options.name = "bench";
    if (transport == "gloo") {
      options.transport = Transport::kGloo;
    } else if (transport == "shm" || transport == "shared_memory") {
      options.transport = Transport::kSharedMemory;
    } else if (transport != "auto") {
      throw std::invalid_argument("--transport=" + transport + ": expected auto, gloo or shm");
    }
    options.shm_chunk_bytes = static_cast<size_t>(shm_chunk_bytes);
    CommunicatorPtr comm = init_communicator(info, options);
    const std::string where = iface.empty() ? info.communicator_options(options).interface : iface;
    if (info.rank == 0) {
      const std::string net = where.empty() ? "TCP to " + info.master_addr : where;
      const std::string how = std::string(comm->transport_name()) == "gloo"
                                  ? "Gloo over " + net
                                  : std::string(comm->transport_name()) + " (send/recv: Gloo over " +
                                        net + ")";
      std::fprintf(stderr, "%s: %d ranks (processes), %s, %d intra-op thread(s)\n", argv[0],
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
    // Nobody closes its connections while a peer still finishes the last collective.
    if (!g_comm_broken) comm->barrier()->wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] %s: %s\n", info.rank, argv[0], e.what());
    ok = false;
  }
  benchmark::Shutdown();
  if (!children.wait_all(timeout_s)) ok = false;
  if (g_failed) ok = false;
  if (!ok && info.rank == 0) std::fprintf(stderr, "%s: FAILED\n", argv[0]);
  return ok ? 0 : 1;
}

}  // namespace dtrain::bench

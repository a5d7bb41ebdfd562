// dtrain-run: starts the ranks of a distributed job on this node, like torchrun.
//
//   dtrain-run --nproc_per_node 2 -- ./my_trainer --flag value
//   dtrain-run --nnodes 2 --node_rank 0 --nproc_per_node 4 --master_addr host0
//              --master_port 29500 -- ./my_trainer        (on node 0; node_rank 1 on the other)
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/blas.h"
#include "launcher/local_ranks.h"

namespace {

constexpr const char* kUsage = R"(usage: dtrain-run [options] [--] program [args...]

Runs `program` once per local rank, with the variables dtrain (and torchrun-style
programs) read to find their peers: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. Waits for every rank. Each rank leads its own process group,
and everything in it is stopped with the rank. If one fails, the others get SIGTERM
(SIGKILL after the grace period), the failed rank and the way it failed are printed, and
dtrain-run exits non-zero. SIGINT/SIGTERM are forwarded to the ranks, SIGHUP/SIGQUIT send
them SIGTERM; a second signal kills them. If dtrain-run itself dies (even by SIGKILL), the
ranks get SIGKILL.

options:
  --nproc_per_node N   ranks on this node (default 1)
  --nnodes M           nodes in the job (default 1)
  --node_rank K        this node's index in [0, M) (default 0); its ranks are K*N .. K*N+N-1
  --master_addr A      host of rank 0, which serves the store (default 127.0.0.1)
  --master_port P      port of the store (default: a free port; required when M > 1)
  --grace_s S          seconds between SIGTERM and SIGKILL when stopping ranks (default 5)
  --blas_kernel K      auto (default): when OpenBLAS would run its generic kernels, or an
                       older family than this CPU supports (e.g. Haswell on an AVX-512 CPU),
                       start the ranks with OPENBLAS_CORETYPE set to the CPU's best family
                       (SkylakeX, Haswell, ...) and say so on stderr. OpenBLAS reads it only
                       when it loads, so only a launcher can choose it. An OPENBLAS_CORETYPE
                       already set is always kept. keep: leave the BLAS as it loads.
  --blas_library L     the BLAS the ranks load, probed for --blas_kernel auto (default
                       libblas.so.3, which Debian's LibTorch links)
  --blas_info          print the BLAS, its kernel, the CPU and what the ranks would get; exit
  -h, --help           this text

exit status: 0 when every rank exited 0; otherwise the failed rank's exit code, or
128 + the signal that killed it, or 128 + the signal dtrain-run received (129 SIGHUP,
130 SIGINT, 131 SIGQUIT, 143 SIGTERM).
)";

struct BlasOptions {
  dtrain::BlasKernelPolicy policy = dtrain::BlasKernelPolicy::kAuto;
  std::string library = "libblas.so.3";
  bool info_only = false;
};

int parse_int(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    const long v = std::stol(value, &used);
    if (used != value.size()) throw std::invalid_argument("trailing characters");
    return static_cast<int>(v);
  } catch (const std::exception&) {
    throw std::invalid_argument(fmt::format("{} expects an integer, got '{}'", flag, value));
  }
}

std::optional<dtrain::launcher::NodeOptions> parse(int argc, char** argv, BlasOptions& blas) {
  dtrain::launcher::NodeOptions o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") return std::nullopt;
    if (arg == "--blas_info") {
      blas.info_only = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) break;  // the program
    std::string value;
    const auto eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      value = argv[++i];
    }
    if (arg == "--nproc_per_node") {
      o.nproc_per_node = parse_int(arg, value);
    } else if (arg == "--nnodes") {
      o.nnodes = parse_int(arg, value);
    } else if (arg == "--node_rank") {
      o.node_rank = parse_int(arg, value);
    } else if (arg == "--master_addr") {
      o.master_addr = value;
    } else if (arg == "--master_port") {
      o.master_port = parse_int(arg, value);
    } else if (arg == "--grace_s") {
      const int s = parse_int(arg, value);
      if (s < 0) throw std::invalid_argument("--grace_s must not be negative");
      o.grace = std::chrono::seconds(s);
    } else if (arg == "--blas_kernel") {
      if (value != "auto" && value != "keep") {
        throw std::invalid_argument("--blas_kernel expects auto or keep, got '" + value + "'");
      }
      blas.policy =
          value == "auto" ? dtrain::BlasKernelPolicy::kAuto : dtrain::BlasKernelPolicy::kKeep;
    } else if (arg == "--blas_library") {
      blas.library = value;
    } else {
      throw std::invalid_argument("unknown option " + arg);
    }
  }
  for (; i < argc; ++i) o.argv.emplace_back(argv[i]);
  if (blas.info_only) return o;
  if (o.argv.empty()) throw std::invalid_argument("no program given");
  if (o.nnodes > 1 && o.master_port == 0) o.master_port = 29500;  // torchrun's default
  dtrain::launcher::validate(o);
  return o;
}

// The BLAS kernel of the ranks: probes the BLAS they will load (here, under this process's
// environment, which they inherit) unless the policy is keep and nothing is to be printed.
dtrain::BlasKernelPlan plan_blas(const BlasOptions& blas, dtrain::BlasInfo& info,
                                 dtrain::CpuFeatures& cpu) {
  cpu = dtrain::CpuFeatures::detect();
  if (blas.policy == dtrain::BlasKernelPolicy::kAuto || blas.info_only) {
    info = dtrain::BlasInfo::probe(blas.library);
  }
  return dtrain::plan_blas_kernel(info, cpu, dtrain::blas_environment_from_env(), blas.policy);
}

void print_blas_info(const BlasOptions& blas, const dtrain::BlasInfo& info,
                     const dtrain::CpuFeatures& cpu, const dtrain::BlasKernelPlan& plan) {
  fmt::print("blas: {} ({})\n", plan.note, blas.library);
  const std::string best = dtrain::best_openblas_kernel(cpu);
  fmt::print("cpu features: {} ({} {}), {}; best OpenBLAS kernel: {}\n",
             cpu.model.empty() ? "unknown model" : cpu.model, cpu.vendor, cpu.arch, cpu.summary(),
             best.empty() ? "none known" : best);
  std::string vars;
  for (const auto& [k, v] : plan.environment) vars += fmt::format(" {}={}", k, v);
  fmt::print("ranks get:{}\n", vars.empty() ? " no BLAS variables" : vars);
  if (!info.config.empty()) fmt::print("config: {}\n", info.config);
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<dtrain::launcher::NodeOptions> options;
  BlasOptions blas;
  try {
    options = parse(argc, argv, blas);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtrain-run: {}\n\n{}", e.what(), kUsage);
    return 2;
  }
  if (!options) {
    fmt::print("{}", kUsage);
    return 0;
  }
  dtrain::BlasInfo info;
  dtrain::CpuFeatures cpu;
  const dtrain::BlasKernelPlan plan = plan_blas(blas, info, cpu);
  if (blas.info_only) {
    print_blas_info(blas, info, cpu, plan);
    return 0;
  }
  // Said whenever the ranks' kernel is not OpenBLAS's own pick, or could be better.
  if (plan.action == dtrain::BlasKernelPlan::Action::kSelect ||
      (plan.action == dtrain::BlasKernelPlan::Action::kUserSet && !plan.missed_kernel.empty())) {
    fmt::print(stderr, "dtrain-run: blas: {}\n", plan.note);
  }
  options->environment = plan.environment;
  try {
    return dtrain::launcher::run_node(*options);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtrain-run: {}\n", e.what());
    return 1;
  }
}

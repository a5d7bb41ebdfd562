// dtrain-run: starts the ranks of a distributed job on this node, like torchrun.
//
//   dtrain-run --nproc_per_node 2 -- ./my_trainer --flag value
//   dtrain-run --nnodes 2 --node_rank 0 --nproc_per_node 4 --master_addr host0
//              --master_port 29500 -- ./my_trainer        (on node 0; node_rank 1 on the other)
//   dtrain-run --nnodes 2 --node_rank 0 --nproc_per_node 4 --rdzv_backend etcd
//              --rdzv_endpoint etcd-host:2379 --rdzv_id job42 -- ./my_trainer
#include <absl/flags/flag.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/blas.h"
#include "dtrain/launcher.h"
#include "dtrain_cli/flags.h"
#include "launcher/elastic.h"

ABSL_FLAG(int, nproc_per_node, 1, "ranks on this node");
ABSL_FLAG(std::string, nnodes, "1",
          "nodes in the job: N (a fixed set, each started with its --node_rank), or MIN:MAX "
          "for an elastic job: an agent per host joins a rendezvous at --master_addr:"
          "--master_port, and generations of MIN to MAX hosts follow one another as hosts fail "
          "or join (with --rdzv_backend etcd, in etcd instead; docs/multinode.md, \"Elastic "
          "runs\")");
ABSL_FLAG(std::string, host_id, "",
          "elastic: this host's name in messages and failure counts (default: the hostname); "
          "letters, digits, '.', '-', '_', ':'");
ABSL_FLAG(std::string, rdzv_id, "",
          "the job's id, the same on every node (torchrun's name; e.g. the Slurm job id). "
          "Elastic agents meet under it in the rendezvous store (default: none). With "
          "--rdzv_backend etcd the ranks' keys live under /dtrain/<id>/ in etcd (elastic "
          "agents' under /dtrain/<id>/agents/) and the ranks get it as TORCHELASTIC_RUN_ID; "
          "required there with more than one node, made up on one node");
ABSL_FLAG(double, rdzv_last_call_s, 5,
          "elastic: a round with at least MIN and fewer than MAX agents closes when nobody has "
          "joined for this long (torchrun's last_call_timeout)");
ABSL_FLAG(double, rdzv_timeout_s, 600,
          "elastic: give up when a round does not close within this long (torchrun's "
          "join_timeout)");
ABSL_FLAG(double, heartbeat_timeout_s, 30,
          "elastic: an agent whose heartbeat (every second, through the store) stops for this "
          "long is lost: the others end the generation");
ABSL_FLAG(int, max_host_failures, 3,
          "elastic: a host whose failure count reaches this is left out of later generations");
ABSL_FLAG(int, node_rank, 0,
          "this node's index in [0, nnodes); its ranks are node_rank * nproc_per_node .. "
          "node_rank * nproc_per_node + nproc_per_node - 1");
ABSL_FLAG(std::string, master_addr, "127.0.0.1", "host of rank 0, which serves the store");
ABSL_FLAG(int, master_port, 0,
          "port of the store; 0: a free port on one node, 29500 (torchrun's default) on several");
ABSL_FLAG(int, grace_s, 5, "seconds between SIGTERM and SIGKILL when stopping ranks");
ABSL_FLAG(int, max_restarts, 0,
          "when a rank fails, stop the others and start every rank again, up to this many "
          "times (torchrun's name); the ranks get TORCHELASTIC_RESTART_COUNT, "
          "TORCHELASTIC_MAX_RESTARTS and DTRAIN_GENERATION. With --nnodes N only for N = 1; "
          "with --nnodes MIN:MAX, failed generations of the whole job");
ABSL_FLAG(std::string, rdzv_backend, "c10d",
          "where the job's store lives (torchrun's name): c10d (also static): the TCP store "
          "rank 0 serves at --master_addr:--master_port, gone with rank 0's host (elastic: "
          "the agents' store, served by the agent on --master_addr); etcd: an external etcd "
          "server at --rdzv_endpoint, for the ranks and elastic agents alike, which survives "
          "the loss of any host");
ABSL_FLAG(std::string, rdzv_endpoint, "",
          "with --rdzv_backend etcd: host:port of the etcd server (several, comma-separated, "
          "for the members of an etcd cluster)");
ABSL_FLAG(std::string, blas_kernel, "auto",
          "auto: when OpenBLAS would run its generic kernels, or an older family than this CPU "
          "supports (e.g. Haswell on an AVX-512 CPU), start the ranks with OPENBLAS_CORETYPE set "
          "to the CPU's best family (SkylakeX, Haswell, ...); --verbose says so on stderr. "
          "OpenBLAS reads it only when it loads, so only a launcher can choose it. An "
          "OPENBLAS_CORETYPE already set is always kept (with a warning when the CPU supports "
          "a better family). keep: leave the BLAS as it loads.");
ABSL_FLAG(std::string, blas_library, "libblas.so.3",
          "the BLAS the ranks load, probed for --blas_kernel auto (Debian's LibTorch links "
          "libblas.so.3)");
ABSL_FLAG(bool, blas_info, false,
          "print the BLAS, its kernel, the CPU (and whether it computes bf16 natively: "
          "cpu_bf16_native) and what the ranks would get; exit");
ABSL_FLAG(bool, verbose, false,
          "print what the launcher decides for the ranks (the BLAS kernel --blas_kernel auto "
          "chose) on stderr before starting them");
ABSL_FLAG(double, join_timeout_s, 0,
          "how long each rank waits for the master and for every other rank before failing "
          "(the ranks get DTRAIN_JOIN_TIMEOUT; they print a line while they wait). 0: as "
          "inherited from this environment, else the program's own (dtrain's default 300 s)");
ABSL_FLAG(bool, help, false, "print this text; exit (also -h)");

namespace {

constexpr const char* kUsage = R"(usage: dtrain-run [options] [--] program [args...]

Runs `program` once per local rank, with the variables dtrain (and torchrun-style
programs) read to find their peers: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. Waits for every rank. Each rank runs under its own supervisor
(dtrain-supervise, installed next to dtrain-run) and leads its own process group. If one
fails, the others get SIGTERM (their whole trees SIGKILL after the grace period), the
failed rank and the way it failed are printed, and dtrain-run exits non-zero.
SIGINT/SIGTERM are forwarded to the ranks, SIGHUP/SIGQUIT send them SIGTERM; a second
signal kills them. No process a rank started outlives it or dtrain-run: when a rank ends,
or dtrain-run ends in any way (even by SIGKILL), its supervisor kills every process of the
rank's tree, including daemons in sessions of their own.

With --max_restarts N, a failed rank stops the others and then every rank starts again (at
most N times; a signal to dtrain-run is never followed by a restart); the ranks see
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS and DTRAIN_GENERATION. A trainer
that resumes from its newest checkpoint continues from there.

Elastic (--nnodes MIN:MAX; start one dtrain-run per host, all with the same --master_addr,
--master_port and --rdzv_id): the agent on master_addr serves the rendezvous store; the
agents form numbered generations of MIN to MAX hosts (WORLD_SIZE = the ranks of the hosts
present). When a rank fails, an agent's heartbeat stops, an agent is signalled or a new one
asks to join, every agent stops its ranks and they form the next generation (a failure uses
one of --max_restarts). Ranks also get DTRAIN_STORE_TOKEN ending in "/generation/N", so a
rank of an old generation is refused by the new one's store.

With --rdzv_backend etcd --rdzv_endpoint HOST:PORT --rdzv_id ID, the ranks meet through an
external etcd server instead of a store served by rank 0 (DTRAIN_RDZV_BACKEND,
DTRAIN_RDZV_ENDPOINT and TORCHELASTIC_RUN_ID in their environment), so the job's store
survives the loss of any of its hosts, rank 0's included. Elastic agents then meet there
too (keys under /dtrain/ID/agents/; no --master_addr needed): the job survives the loss of
any host while MIN remain.

GPUs: CUDA_VISIBLE_DEVICES is passed on unchanged, and each rank picks its GPU by dtrain's
device contract (dtrain/rendezvous.h, LaunchInfo::cuda_device): GPU LOCAL_RANK, or 0 when
CUDA_VISIBLE_DEVICES shows the rank a single GPU. With NCCL, more ranks per node than GPUs
is refused by the ranks, before NCCL starts.

Options come before the program, as --name=value or --name value.
exit status: 0 when every rank exited 0; otherwise the failed rank's exit code, or
128 + the signal that killed it, or 128 + the signal dtrain-run received (129 SIGHUP,
130 SIGINT, 131 SIGQUIT, 143 SIGTERM); 2 for a usage error.

)";

// The ranks' rendezvous variables for --rdzv_backend / --rdzv_endpoint / --rdzv_id.
std::map<std::string, std::string> rendezvous_environment(int nnodes) {
  const std::string backend = absl::GetFlag(FLAGS_rdzv_backend);
  std::string endpoint = absl::GetFlag(FLAGS_rdzv_endpoint);
  std::string id = absl::GetFlag(FLAGS_rdzv_id);
  if (backend == "c10d" || backend == "static") {
    if (!endpoint.empty())
      throw std::invalid_argument(
          "--rdzv_endpoint is for --rdzv_backend etcd; the built-in "
          "store is at --master_addr and --master_port");
    return {};
  }
  if (backend != "etcd")
    throw std::invalid_argument("--rdzv_backend expects c10d, static or etcd, got '" + backend +
                                "'");
  if (endpoint.empty())
    throw std::invalid_argument(
        "--rdzv_backend etcd needs --rdzv_endpoint HOST:PORT (the etcd "
        "server's client URL)");
  if (id.empty()) {
    if (nnodes > 1)
      throw std::invalid_argument(
          "--rdzv_backend etcd with --nnodes > 1 needs --rdzv_id: the "
          "same id on every node, new for every job");
    // One node: nobody else must agree on it, and a fresh id never meets an old run's keys.
    std::random_device rd;
    id = fmt::format("dtrain-run-{}-{:08x}", getpid(), rd());
  }
  if (id.find('/') != std::string::npos)
    throw std::invalid_argument("--rdzv_id must not contain '/', got '" + id + "'");
  return {{"DTRAIN_RDZV_BACKEND", "etcd"},
          {"DTRAIN_RDZV_ENDPOINT", endpoint},
          {"TORCHELASTIC_RUN_ID", id}};
}

struct BlasOptions {
  dtrain::BlasKernelPolicy policy = dtrain::BlasKernelPolicy::kAuto;
  std::string library;
  bool info_only = false;
  bool verbose = false;  // say which kernel the ranks get (a warning is said regardless)
};

// The options before the program; nullopt for -h/--help.
std::optional<dtrain::launcher::NodeOptions> parse(int argc, char** argv, BlasOptions& blas,
                                                   dtrain::launcher::ElasticOptions& elastic) {
  const std::vector<std::string> args(argv, argv + argc);
  const size_t program = dtrain::cli::parse_flags(args, 1, dtrain::cli::Positional::kStop);
  const bool dash_h = program < args.size() && args[program] == "-h" && args[program - 1] != "--";
  if (absl::GetFlag(FLAGS_help) || dash_h) return std::nullopt;
  dtrain::launcher::NodeOptions o;
  o.argv.assign(args.begin() + static_cast<std::ptrdiff_t>(program), args.end());
  o.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  const std::string nnodes = absl::GetFlag(FLAGS_nnodes);
  elastic.max_nodes = 0;
  const size_t colon = nnodes.find(':');
  auto number = [&](const std::string& text) {
    size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != text.size()) {
      throw std::invalid_argument("--nnodes expects N or MIN:MAX, got '" + nnodes + "'");
    }
    return v;
  };
  if (colon == std::string::npos) {
    o.nnodes = number(nnodes);
  } else {
    elastic.min_nodes = number(nnodes.substr(0, colon));
    elastic.max_nodes = number(nnodes.substr(colon + 1));
  }
  o.node_rank = absl::GetFlag(FLAGS_node_rank);
  o.master_addr = absl::GetFlag(FLAGS_master_addr);
  o.master_port = absl::GetFlag(FLAGS_master_port);
  const int grace_s = absl::GetFlag(FLAGS_grace_s);
  if (grace_s < 0) throw std::invalid_argument("--grace_s must not be negative");
  o.grace = std::chrono::seconds(grace_s);
  o.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  const std::string kernel = absl::GetFlag(FLAGS_blas_kernel);
  if (kernel != "auto" && kernel != "keep") {
    throw std::invalid_argument("--blas_kernel expects auto or keep, got '" + kernel + "'");
  }
  blas.policy =
      kernel == "auto" ? dtrain::BlasKernelPolicy::kAuto : dtrain::BlasKernelPolicy::kKeep;
  blas.library = absl::GetFlag(FLAGS_blas_library);
  blas.info_only = absl::GetFlag(FLAGS_blas_info);
  blas.verbose = absl::GetFlag(FLAGS_verbose);
  if (blas.info_only) return o;
  if (o.argv.empty()) throw std::invalid_argument("no program given");
  if ((o.nnodes > 1 || elastic.max_nodes > 0) && o.master_port == 0) {
    o.master_port = 29500;  // torchrun's default
  }
  // Elastic agents must agree on the id too: count them as MAX nodes.
  o.environment = rendezvous_environment(std::max(o.nnodes, elastic.max_nodes));
  const double join_timeout_s = absl::GetFlag(FLAGS_join_timeout_s);
  if (!(join_timeout_s >= 0) || join_timeout_s > 7 * 24 * 3600.0)
    throw std::invalid_argument(
        fmt::format("--join_timeout_s={} must be in [0, 604800] seconds", join_timeout_s));
  if (join_timeout_s > 0)
    o.environment["DTRAIN_JOIN_TIMEOUT"] = fmt::format("{:g}", join_timeout_s);
  if (elastic.max_nodes == 0) {
    dtrain::launcher::validate(o);
    return o;
  }
  elastic.host_id = absl::GetFlag(FLAGS_host_id);
  if (elastic.host_id.empty()) {
    char host[256] = {0};
    if (gethostname(host, sizeof(host) - 1) == 0) elastic.host_id = host;
  }
  auto duration = [](double s, const char* name) {
    if (!(s >= 0) || s > 1e7) throw std::invalid_argument(fmt::format("--{} out of range", name));
    return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  };
  elastic.last_call = duration(absl::GetFlag(FLAGS_rdzv_last_call_s), "rdzv_last_call_s");
  elastic.join_timeout = duration(absl::GetFlag(FLAGS_rdzv_timeout_s), "rdzv_timeout_s");
  elastic.heartbeat_timeout =
      duration(absl::GetFlag(FLAGS_heartbeat_timeout_s), "heartbeat_timeout_s");
  elastic.max_host_failures = absl::GetFlag(FLAGS_max_host_failures);
  elastic.rdzv_id = absl::GetFlag(FLAGS_rdzv_id);
  if (elastic.rdzv_id.empty()) elastic.rdzv_id = "none";  // torchrun's default
  if (elastic.rdzv_id.find('/') != std::string::npos) {
    throw std::invalid_argument("--rdzv_id must not contain '/'");
  }
  elastic.node = o;
  dtrain::launcher::validate(elastic);
  return o;
}

// The BLAS kernel of the ranks: probes the BLAS they will load (here, under this process's
// environment, which they inherit) unless the policy is keep and nothing is to be printed.
dtrain::BlasKernelPlan plan_blas(const BlasOptions& blas, dtrain::BlasInfo& info,
                                 dtrain::CpuFeatures& cpu) {
  cpu = dtrain::cpu_features_from_env();
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
  // scripts/run-comparison.sh reads this line to decide whether its bf16 variant runs.
  fmt::print("cpu_bf16_native: {}\n",
             cpu.native_bf16()
                 ? "true (" + cpu.bf16_features() + ")"
                 : std::string("false (no avx512_bf16 or amx_bf16: bf16 is emulated)"));
  std::string vars;
  for (const auto& [k, v] : plan.environment) vars += fmt::format(" {}={}", k, v);
  fmt::print("ranks get:{}\n", vars.empty() ? " no BLAS variables" : vars);
  if (!info.config.empty()) fmt::print("config: {}\n", info.config);
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<dtrain::launcher::NodeOptions> options;
  BlasOptions blas;
  dtrain::launcher::ElasticOptions elastic;
  try {
    options = parse(argc, argv, blas, elastic);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtrain-run: {}\n\n{}{}", e.what(), kUsage, dtrain::cli::flags_help());
    return 2;
  }
  if (!options) {
    fmt::print("{}{}", kUsage, dtrain::cli::flags_help());
    return 0;
  }
  dtrain::BlasInfo info;
  dtrain::CpuFeatures cpu;
  dtrain::BlasKernelPlan plan;
  try {
    plan = plan_blas(blas, info, cpu);
  } catch (const std::exception& e) {  // a bad DTRAIN_HIDE_NATIVE_BF16
    fmt::print(stderr, "dtrain-run: {}\n", e.what());
    return 2;
  }
  if (blas.info_only) {
    print_blas_info(blas, info, cpu, plan);
    return 0;
  }
  // A choice is said on request (programs such as gpt2_train record the kernel they run with);
  // a user's OPENBLAS_CORETYPE that leaves a better kernel unused is said always.
  if ((blas.verbose && plan.action == dtrain::BlasKernelPlan::Action::kSelect) ||
      (plan.action == dtrain::BlasKernelPlan::Action::kUserSet && !plan.missed_kernel.empty())) {
    fmt::print(stderr, "dtrain-run: blas: {}\n", plan.note);
  }
  options->environment.insert(plan.environment.begin(), plan.environment.end());
  try {
    if (elastic.max_nodes > 0) {
      elastic.node.environment.insert(plan.environment.begin(), plan.environment.end());
      // The agents present the job's token (if any) to their store; the ranks of
      // generation N get it with "/generation/N" appended.
      const char* token = std::getenv("DTRAIN_STORE_TOKEN");
      elastic.token = token != nullptr ? token : "";
      const auto backend = options->environment.find("DTRAIN_RDZV_BACKEND");
      if (backend != options->environment.end() && backend->second == "etcd") {
        // Nothing the job needs lives in an agent: any host can be lost (docs/multinode.md).
        elastic.ranks_on_etcd = true;
        elastic.rdzv_id = options->environment.at("TORCHELASTIC_RUN_ID");
        return dtrain::launcher::run_elastic(
            elastic, dtrain::launcher::make_agent_etcd_store(
                         options->environment.at("DTRAIN_RDZV_ENDPOINT"), elastic.rdzv_id));
      }
      auto store = dtrain::launcher::make_agent_store(options->master_addr, options->master_port,
                                                      elastic.token, elastic.serves_store);
      return dtrain::launcher::run_elastic(
          elastic, dtrain::make_prefix_store("dtrain-run/" + elastic.rdzv_id, store));
    }
    return dtrain::launcher::run_node(*options);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtrain-run: {}\n", e.what());
    return 1;
  }
}

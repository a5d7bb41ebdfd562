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

#include "launcher/local_ranks.h"

namespace {

constexpr const char* kUsage = R"(usage: dtrain-run [options] [--] program [args...]

Runs `program` once per local rank, with the variables dtrain (and torchrun-style
programs) read to find their peers: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. Waits for every rank. If one fails, the others get SIGTERM
(SIGKILL after the grace period), the failed rank and the way it failed are printed, and
dtrain-run exits non-zero. SIGINT/SIGTERM are forwarded to the ranks.

options:
  --nproc_per_node N   ranks on this node (default 1)
  --nnodes M           nodes in the job (default 1)
  --node_rank K        this node's index in [0, M) (default 0); its ranks are K*N .. K*N+N-1
  --master_addr A      host of rank 0, which serves the store (default 127.0.0.1)
  --master_port P      port of the store (default: a free port; required when M > 1)
  --grace_s S          seconds between SIGTERM and SIGKILL when stopping ranks (default 5)
  -h, --help           this text

exit status: 0 when every rank exited 0; otherwise the failed rank's exit code, or
128 + the signal that killed it.
)";

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

std::optional<dtrain::launcher::NodeOptions> parse(int argc, char** argv) {
  dtrain::launcher::NodeOptions o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") return std::nullopt;
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
    } else {
      throw std::invalid_argument("unknown option " + arg);
    }
  }
  for (; i < argc; ++i) o.argv.emplace_back(argv[i]);
  if (o.argv.empty()) throw std::invalid_argument("no program given");
  if (o.nnodes > 1 && o.master_port == 0) o.master_port = 29500;  // torchrun's default
  dtrain::launcher::validate(o);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<dtrain::launcher::NodeOptions> options;
  try {
    options = parse(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtrain-run: {}\n\n{}", e.what(), kUsage);
    return 2;
  }
  if (!options) {
    fmt::print("{}", kUsage);
    return 0;
  }
  try {
    return dtrain::launcher::run_node(*options);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtrain-run: {}\n", e.what());
    return 1;
  }
}

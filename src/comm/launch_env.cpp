// LaunchInfo::from_env: the launcher conventions (see dtrain/rendezvous.h), and the only
// place dtrain reads the launch environment.
#include "comm/launch_env.h"

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <stdexcept>

#include <fmt/format.h>

#include "comm/store/etcd_http.h"
#include "comm/store/protocol.h"
#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"

extern char** environ;

namespace dtrain {
namespace launch_env {

std::vector<int> expand_tasks_per_node(const std::string& list) {
  std::vector<int> out;
  size_t i = 0;
  auto number = [&](const char* what) {
    size_t start = i;
    while (i < list.size() && list[i] >= '0' && list[i] <= '9') ++i;
    if (i == start || i - start > 6)
      throw std::invalid_argument(fmt::format("'{}': expected {} at offset {}", list, what, start));
    return std::stoi(list.substr(start, i - start));
  };
  while (i < list.size()) {
    const int tasks = number("a task count");
    int repeat = 1;
    if (list.compare(i, 2, "(x") == 0) {
      i += 2;
      repeat = number("a repeat count");
      if (i >= list.size() || list[i] != ')')
        throw std::invalid_argument(fmt::format("'{}': missing ')'", list));
      ++i;
    }
    if (repeat < 1 || out.size() + static_cast<size_t>(repeat) > 1000000)
      throw std::invalid_argument(fmt::format("'{}': bad repeat count", list));
    out.insert(out.end(), static_cast<size_t>(repeat), tasks);
    if (i < list.size()) {
      if (list[i] != ',') throw std::invalid_argument(fmt::format("'{}': expected ','", list));
      ++i;
      if (i == list.size()) throw std::invalid_argument(fmt::format("'{}': trailing ','", list));
    }
  }
  if (out.empty()) throw std::invalid_argument("empty tasks-per-node list");
  return out;
}

std::string first_host(const std::string& hostlist) {
  std::string host;
  size_t i = 0;
  while (i < hostlist.size() && hostlist[i] != ',') {
    if (hostlist[i] != '[') {
      if (hostlist[i] == ']') throw std::invalid_argument(fmt::format("'{}': stray ']'", hostlist));
      host += hostlist[i++];
      continue;
    }
    const size_t close = hostlist.find(']', i);
    if (close == std::string::npos)
      throw std::invalid_argument(fmt::format("'{}': missing ']'", hostlist));
    const std::string range = hostlist.substr(i + 1, close - i - 1);
    const std::string first = range.substr(0, range.find_first_of(",-"));
    if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos)
      throw std::invalid_argument(fmt::format("'{}': bad range [{}]", hostlist, range));
    host += first;
    i = close + 1;
  }
  if (host.empty()) throw std::invalid_argument(fmt::format("'{}': no host", hostlist));
  return host;
}

}  // namespace launch_env

namespace {

using Env = std::map<std::string, std::string>;

[[noreturn]] void fail(const std::string& why) {
  throw InvalidArgument(ErrorContext{-1, -1, "LaunchInfo::from_env", -1}, why);
}

const std::string* lookup(const Env& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

// Absent -> fallback; malformed -> InvalidArgument naming the variable.
int get_int(const Env& env, const std::string& name, int fallback) {
  const std::string* v = lookup(env, name);
  if (v == nullptr) return fallback;
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(v->c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || x < INT_MIN || x > INT_MAX)
    fail(fmt::format("{}='{}' is not an integer", name, *v));
  return static_cast<int>(x);
}

int require_int(const Env& env, const std::string& name, const std::string& convention) {
  if (lookup(env, name) == nullptr)
    fail(fmt::format("{} is set but {} is not: incomplete {} launch environment", convention, name,
                     convention));
  return get_int(env, name, 0);
}

// Names of the variables each field came from, for error messages.
struct Names {
  std::string rank, world, local_rank, local_world;
};

void check_consistent(const LaunchInfo& i, const Names& n) {
  if (i.world_size < 1) fail(fmt::format("{}={} must be >= 1", n.world, i.world_size));
  if (i.rank < 0 || i.rank >= i.world_size)
    fail(fmt::format("{}={} must be in [0, {}={})", n.rank, i.rank, n.world, i.world_size));
  if (i.local_world_size < 1 || i.local_world_size > i.world_size)
    fail(fmt::format("{}={} must be in [1, {}={}]", n.local_world, i.local_world_size, n.world,
                     i.world_size));
  if (i.local_rank < 0 || i.local_rank >= i.local_world_size)
    fail(fmt::format("{}={} must be in [0, {}={})", n.local_rank, i.local_rank, n.local_world,
                     i.local_world_size));
}

bool read_torchrun(const Env& env, LaunchInfo& i) {
  if (!lookup(env, "RANK") && !lookup(env, "WORLD_SIZE")) return false;
  const std::string c = "torchrun-style (RANK/WORLD_SIZE)";
  // A bad value is the more useful message than the missing partner.
  const int world = get_int(env, "WORLD_SIZE", 1);
  if (world < 1) fail(fmt::format("WORLD_SIZE={} must be >= 1", world));
  i.rank = require_int(env, "RANK", c);
  i.world_size = require_int(env, "WORLD_SIZE", c);
  i.local_rank = get_int(env, "LOCAL_RANK", i.rank);
  i.local_world_size = get_int(env, "LOCAL_WORLD_SIZE", i.world_size);
  check_consistent(i, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"});
  i.source = LaunchSource::kTorchrun;
  return true;
}

bool read_open_mpi(const Env& env, LaunchInfo& i) {
  const Names n{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"};
  if (!lookup(env, n.rank) && !lookup(env, n.world)) return false;
  const std::string c = "Open MPI (mpirun)";
  i.rank = require_int(env, n.rank, c);
  i.world_size = require_int(env, n.world, c);
  i.local_rank = require_int(env, n.local_rank, c);
  i.local_world_size = require_int(env, n.local_world, c);
  check_consistent(i, n);
  if (!lookup(env, "MASTER_ADDR") && i.local_world_size < i.world_size)
    fail(
        fmt::format("mpirun started {} ranks on several hosts ({} on this one) but MASTER_ADDR "
                    "is not set; pass rank 0's host, e.g. mpirun -x MASTER_ADDR=<host> ...",
                    i.world_size, i.local_world_size));
  i.source = LaunchSource::kOpenMpi;
  return true;
}

bool read_slurm(const Env& env, LaunchInfo& i) {
  if (!lookup(env, "SLURM_PROCID")) return false;
  const std::string c = "Slurm (SLURM_PROCID)";
  i.rank = require_int(env, "SLURM_PROCID", c);
  i.world_size = require_int(env, "SLURM_NTASKS", c);
  i.local_rank = require_int(env, "SLURM_LOCALID", c);
  std::string local_name;
  for (const char* name :
       {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const std::string* v = lookup(env, name);
    if (v == nullptr) continue;
    std::vector<int> per_node;
    try {
      per_node = launch_env::expand_tasks_per_node(*v);
    } catch (const std::exception& e) {
      fail(fmt::format("{}: {}", name, e.what()));
    }
    const int node = get_int(env, "SLURM_NODEID", -1);
    if (per_node.size() == 1) {
      i.local_world_size = per_node[0];
    } else if (node >= 0 && static_cast<size_t>(node) < per_node.size()) {
      i.local_world_size = per_node[static_cast<size_t>(node)];
    } else {
      fail(fmt::format("{}='{}' lists {} hosts but SLURM_NODEID is {}", name, *v, per_node.size(),
                       node < 0 ? "not set" : std::to_string(node)));
    }
    local_name = name;
    break;
  }
  if (local_name.empty())
    fail(
        "Slurm: none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, "
        "SLURM_TASKS_PER_NODE is set: cannot tell how many ranks share this host");
  check_consistent(i, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_name});
  if (!lookup(env, "MASTER_ADDR")) {
    const std::string* list = lookup(env, "SLURM_STEP_NODELIST");
    const char* list_name = "SLURM_STEP_NODELIST";
    if (list == nullptr) list = lookup(env, list_name = "SLURM_JOB_NODELIST");
    if (list == nullptr) list = lookup(env, list_name = "SLURM_NODELIST");
    if (list == nullptr)
      fail("Slurm: neither MASTER_ADDR nor SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is set");
    try {
      i.master_addr = launch_env::first_host(*list);
    } catch (const std::exception& e) {
      fail(fmt::format("{}: {}", list_name, e.what()));
    }
  }
  if (!lookup(env, "MASTER_PORT")) {
    const int job = get_int(env, "SLURM_JOB_ID", 0);
    i.master_port = 29500 + (job < 0 ? 0 : job % 1000);
  }
  i.source = LaunchSource::kSlurm;
  return true;
}

void read_rendezvous(const Env& env, LaunchInfo& info) {
  if (const std::string* b = lookup(env, "DTRAIN_RDZV_BACKEND")) {
    if (*b == "etcd" || *b == "etcd-v2") {
      info.rdzv_backend = RendezvousBackend::kEtcd;
    } else if (*b != "c10d" && *b != "static" && *b != "tcp") {
      fail(
          fmt::format("DTRAIN_RDZV_BACKEND='{}': expected c10d (the built-in TCP store; also "
                      "static or tcp) or etcd",
                      *b));
    }
  }
  if (const std::string* e = lookup(env, "DTRAIN_RDZV_ENDPOINT")) info.rdzv_endpoint = *e;
  if (info.rdzv_backend == RendezvousBackend::kEtcd) {
    if (info.rdzv_endpoint.empty())
      fail(
          "DTRAIN_RDZV_BACKEND=etcd needs DTRAIN_RDZV_ENDPOINT (host:port of the etcd server, "
          "dtrain-run's --rdzv_endpoint)");
    try {
      detail::parse_etcd_endpoints(info.rdzv_endpoint);
    } catch (const std::invalid_argument& e) {
      fail(fmt::format("DTRAIN_RDZV_ENDPOINT: {}", e.what()));
    }
  }
  if (const std::string* id = lookup(env, "TORCHELASTIC_RUN_ID")) info.run_id = *id;
  // The generation an elastic launcher numbers; a plain restart count where only that is set.
  info.generation = get_int(env, "TORCHELASTIC_RESTART_COUNT", 0);
  info.generation = get_int(env, "DTRAIN_GENERATION", info.generation);
  if (info.generation < 0) fail(fmt::format("DTRAIN_GENERATION={} must be >= 0", info.generation));
}

}  // namespace

const char* to_string(RendezvousBackend backend) {
  return backend == RendezvousBackend::kEtcd ? "etcd" : "c10d";
}

const char* to_string(LaunchSource source) {
  switch (source) {
    case LaunchSource::kNone:
      return "none";
    case LaunchSource::kTorchrun:
      return "torchrun";
    case LaunchSource::kOpenMpi:
      return "mpirun";
    case LaunchSource::kSlurm:
      return "slurm";
  }
  return "?";
}

LaunchInfo LaunchInfo::from_env() {
  Env env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return from_env(env);
}

LaunchInfo LaunchInfo::from_env(const std::map<std::string, std::string>& env) {
  LaunchInfo info;
  if (const std::string* a = lookup(env, "MASTER_ADDR")) info.master_addr = *a;
  info.master_port = get_int(env, "MASTER_PORT", info.master_port);
  if (!read_torchrun(env, info) && !read_open_mpi(env, info)) read_slurm(env, info);
  if (const std::string* check = lookup(env, "DTRAIN_COLLECTIVE_CHECK")) {
    info.collective_check = true;
    if (*check == "fingerprint") {
      info.consistency = Consistency::kFingerprint;
    } else if (*check != "cheap") {
      fail(fmt::format("DTRAIN_COLLECTIVE_CHECK='{}': expected cheap or fingerprint", *check));
    }
  }
  if (const std::string* t = lookup(env, "DTRAIN_TRANSPORT")) {
    if (*t == "gloo") {
      info.transport = Transport::kGloo;
    } else if (*t == "shm" || *t == "shared_memory") {
      info.transport = Transport::kSharedMemory;
    } else if (*t != "auto") {
      fail(fmt::format("DTRAIN_TRANSPORT='{}': expected auto, gloo or shm", *t));
    }
  }
  if (const std::string* ifname = lookup(env, "GLOO_SOCKET_IFNAME")) {
    if (ifname->find(',') != std::string::npos)
      fail(fmt::format("GLOO_SOCKET_IFNAME='{}': dtrain listens on one interface; name one",
                       *ifname));
    info.socket_interface = *ifname;
  }
  if (const std::string* token = lookup(env, "DTRAIN_STORE_TOKEN")) {
    if (token->size() > store_protocol::kMaxTokenBytes)
      fail(fmt::format("DTRAIN_STORE_TOKEN is {} bytes long; at most {}", token->size(),
                       store_protocol::kMaxTokenBytes));
    info.store_token = *token;
  }
  if (const std::string* t = lookup(env, "DTRAIN_JOIN_TIMEOUT")) {
    errno = 0;
    char* end = nullptr;
    const double seconds = std::strtod(t->c_str(), &end);
    // At least a millisecond, at most a week: a typo (ms for s) should fail, not hang for days.
    if (errno != 0 || *end != '\0' || !(seconds >= 0.001 && seconds <= 7 * 24 * 3600.0))
      fail(fmt::format("DTRAIN_JOIN_TIMEOUT='{}': expected seconds in [0.001, 604800]", *t));
    info.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
  }
  read_rendezvous(env, info);
  // Read even when empty: CUDA_VISIBLE_DEVICES="" hides every device.
  if (auto it = env.find("CUDA_VISIBLE_DEVICES"); it != env.end())
    info.cuda_visible_devices = it->second;
  info.validate();
  return info;
}

}  // namespace dtrain

#include "dtrain/rendezvous.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace dtrain {
namespace {

// Reads an integer variable; absent -> fallback; malformed -> InvalidArgument.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < INT_MIN || x > INT_MAX) {
    throw InvalidArgument(ErrorContext{-1, -1, "LaunchInfo::from_env", -1},
                          fmt::format("{}='{}' is not an integer", name, v));
  }
  return static_cast<int>(x);
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace

LaunchInfo LaunchInfo::from_env() {
  LaunchInfo info;
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') info.master_addr = a;
  info.master_port = env_int("MASTER_PORT", info.master_port);
  info.rank = env_int("RANK", 0);
  info.world_size = env_int("WORLD_SIZE", 1);
  info.local_rank = env_int("LOCAL_RANK", info.rank);
  info.local_world_size = env_int("LOCAL_WORLD_SIZE", info.world_size);
  info.validate();
  return info;
}

void LaunchInfo::validate() const {
  auto fail = [](const std::string& why) {
    throw InvalidArgument(ErrorContext{-1, -1, "LaunchInfo", -1}, why);
  };
  if (world_size < 1) fail(fmt::format("WORLD_SIZE={} must be >= 1", world_size));
  if (rank < 0 || rank >= world_size)
    fail(fmt::format("RANK={} must be in [0, WORLD_SIZE={})", rank, world_size));
  if (local_world_size < 1 || local_world_size > world_size)
    fail(fmt::format("LOCAL_WORLD_SIZE={} must be in [1, WORLD_SIZE={}]", local_world_size,
                     world_size));
  if (local_rank < 0 || local_rank >= local_world_size)
    fail(fmt::format("LOCAL_RANK={} must be in [0, LOCAL_WORLD_SIZE={})", local_rank,
                     local_world_size));
  if (master_port < 1 || master_port > 65535)
    fail(fmt::format("MASTER_PORT={} must be in [1, 65535]", master_port));
  if (master_addr.empty()) fail("MASTER_ADDR is empty");
}

std::shared_ptr<Store> connect_store(const LaunchInfo& info, std::chrono::milliseconds timeout) {
  info.validate();
  TcpStoreOptions o;
  o.host = info.master_addr;
  o.port = static_cast<uint16_t>(info.master_port);
  o.is_server = info.rank == 0;
  o.world_size = info.world_size;
  o.timeout = timeout;
  return make_tcp_store(o);
}

CommunicatorPtr init_communicator(const LaunchInfo& info, const CommunicatorOptions& options) {
  info.validate();
  CommunicatorOptions o = options;
  if (o.hostname.empty() && o.interface.empty()) {
    if (is_loopback(info.master_addr)) {
      o.hostname = "127.0.0.1";
    } else {
      char name[HOST_NAME_MAX + 1] = {0};
      if (gethostname(name, sizeof(name) - 1) != 0) {
        throw CommError(ErrorContext{info.rank, info.world_size, "init_communicator", -1},
                        "gethostname failed; set CommunicatorOptions::hostname or interface");
      }
      o.hostname = name;
    }
  }
  if (o.device_index < 0 && o.backend == Backend::kNccl) o.device_index = info.local_rank;
  std::shared_ptr<Store> store =
      info.world_size == 1 ? make_memory_store() : connect_store(info, o.timeout);
  return make_communicator(std::move(store), info.rank, info.world_size, o);
}

}  // namespace dtrain

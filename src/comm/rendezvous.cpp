#include "dtrain/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <thread>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/etcd_store.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

int64_t get_int(Store& store, const std::string& key) { return store.add(key, 0); }

// Where the store is, for messages.
std::string store_location(const LaunchInfo& info) {
  if (info.rdzv_backend == RendezvousBackend::kEtcd)
    return fmt::format("etcd {} (run '{}', generation {})", info.rdzv_endpoint, info.run_id,
                       info.generation);
  return fmt::format("{}:{}", info.master_addr, info.master_port);
}

// Checks, through the store, that every rank of [0, world_size) is claimed by exactly one
// process and that all agree on world_size; a failure seen by one rank is published under
// "error" so that every rank fails with the same message instead of waiting out its timeout.
class LaunchCheck {
 public:
  LaunchCheck(std::shared_ptr<Store> store, const LaunchInfo& info,
              std::chrono::milliseconds timeout)
      : store_(make_prefix_store("dtrain/launch", std::move(store))),
        info_(info),
        timeout_(timeout),
        ctx_{info.rank, info.world_size, "rendezvous", -1} {}

  void run() {
    store_->add("claims", 1);
    const std::string me = describe();
    if (store_->add(fmt::format("claim/{}", info_.rank), 1) > 1) {
      std::string other = "another process";
      try {
        other =
            description(store_->get_string(fmt::format("info/{}", info_.rank),
                                           std::min(timeout_, std::chrono::milliseconds(5000))));
      } catch (const TimeoutError&) {
      }
      std::string etcd;
      if (info_.rdzv_backend == RendezvousBackend::kEtcd) {
        etcd = fmt::format(
            " Or does etcd still hold an earlier run with this run id? Pick a "
            "new --rdzv_id (TORCHELASTIC_RUN_ID), or remove the old keys with "
            "`etcdctl del --prefix /dtrain/{}/`.",
            info_.run_id);
      }
      fail(
          fmt::format("rank {} is claimed twice: by {} and by {}; were two hosts started with "
                      "the same --node_rank, or with different --nnodes / --nproc_per_node?{}",
                      info_.rank, other, me, etcd));
    }
    store_->set(fmt::format("info/{}", info_.rank), fmt::format("{}\n{}", info_.world_size, me));
    const std::string first = store_->get_string("info/0", timeout_);
    if (std::atoi(first.c_str()) != info_.world_size) {
      fail(
          fmt::format("rank 0 ({}) and rank {} ({}) disagree on the world size; were hosts "
                      "started with different --nnodes / --nproc_per_node?",
                      description(first), info_.rank, me));
    }
    store_->add("joined", 1);
    wait_for_all();
  }

 private:
  std::string describe() const {
    char host[HOST_NAME_MAX + 1] = {0};
    if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '?';
    return fmt::format("pid {} on {} ({}) with WORLD_SIZE={} LOCAL_RANK={} LOCAL_WORLD_SIZE={}",
                       getpid(), host, store_->network_address(), info_.world_size,
                       info_.local_rank, info_.local_world_size);
  }

  // An info record is "<world size>\n<description>".
  static std::string description(const std::string& record) {
    return record.substr(std::min(record.size(), record.find('\n') + 1));
  }

  void wait_for_all() {
    const auto deadline = Clock::now() + timeout_;
    auto backoff = std::chrono::milliseconds(1);
    for (;;) {
      if (store_->check({"error"})) fail(store_->get_string("error", timeout_), false);
      const int64_t joined = get_int(*store_, "joined");
      if (joined >= info_.world_size) return;
      if (Clock::now() >= deadline) {
        throw TimeoutError(ctx_,
                           fmt::format("only {} of {} ranks joined at {} within {} ms", joined,
                                       info_.world_size, store_location(info_), timeout_.count()));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
    }
  }

  // Publishes `why` (unless it came from the store) and throws it. Rank 0 may serve the
  // store: it lingers briefly so that the others read the error before the store goes away.
  [[noreturn]] void fail(const std::string& why, bool publish = true) {
    if (publish && !store_->check({"error"})) store_->set("error", why);
    store_->add("error_seen", 1);
    if (info_.rank == 0) {
      const auto until = Clock::now() + std::min(timeout_, std::chrono::milliseconds(3000));
      while (Clock::now() < until && get_int(*store_, "error_seen") < get_int(*store_, "claims")) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    throw InvalidArgument(ctx_, why);
  }

  std::shared_ptr<Store> store_;
  const LaunchInfo& info_;
  std::chrono::milliseconds timeout_;
  ErrorContext ctx_;
};

}  // namespace

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
  if (rdzv_backend == RendezvousBackend::kEtcd && rdzv_endpoint.empty())
    fail("rdzv_backend etcd needs rdzv_endpoint (DTRAIN_RDZV_ENDPOINT): host:port of etcd");
  if (rdzv_backend == RendezvousBackend::kEtcd && run_id.empty())
    fail("rdzv_backend etcd needs a run id (TORCHELASTIC_RUN_ID)");
  if (generation < 0) fail(fmt::format("generation {} must be >= 0", generation));
}

CommunicatorOptions LaunchInfo::communicator_options(CommunicatorOptions options) const {
  if (options.interface.empty() && options.hostname.empty()) options.interface = socket_interface;
  if (options.device_index < 0 && options.backend == Backend::kNccl)
    options.device_index = cuda_device(cuda_device_count(), options.backend);
  if (consistency > options.consistency) options.consistency = consistency;
  if (collective_check) options.nccl_call_check = true;
  if (options.transport == Transport::kAuto) options.transport = transport;
  return options;
}

namespace {

std::shared_ptr<Store> make_launch_store(const LaunchInfo& info,
                                         std::chrono::milliseconds timeout) {
  if (info.rdzv_backend == RendezvousBackend::kEtcd) {
    EtcdStoreOptions o;
    o.endpoints = info.rdzv_endpoint;
    o.key_prefix = fmt::format("/dtrain/{}/{}/", info.run_id, info.generation);
    o.timeout = timeout;
    return make_etcd_store(o);
  }
  TcpStoreOptions o;
  o.host = info.master_addr;
  o.port = static_cast<uint16_t>(info.master_port);
  o.is_server = info.rank == 0;
  o.timeout = timeout;
  o.token = info.store_token;
  return make_tcp_store(o);
}

}  // namespace

std::shared_ptr<Store> connect_store(const LaunchInfo& info, std::chrono::milliseconds timeout) {
  info.validate();
  const bool etcd = info.rdzv_backend == RendezvousBackend::kEtcd;
  std::shared_ptr<Store> store;
  try {
    store = make_launch_store(info, timeout);
  } catch (const Error& e) {
    // Name the rank and the master: the store's own message knows neither.
    const ErrorContext ctx{info.rank, info.world_size, "rendezvous", -1};
    if (dynamic_cast<const TimeoutError*>(&e)) {
      throw TimeoutError(ctx, fmt::format("{} {} unreachable: {}", etcd ? "etcd" : "master",
                                          store_location(info), e.cause()));
    }
    if (dynamic_cast<const InvalidArgument*>(&e)) throw InvalidArgument(ctx, e.cause());
    throw CommError(ctx, e.cause());
  }
  try {
    LaunchCheck(store, info, timeout).run();
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& e) {
    if (e.context().rank >= 0) throw;
    // A store call failed: say which rank, and what a silent or closed server may mean.
    const ErrorContext ctx{info.rank, info.world_size, "rendezvous", -1};
    const std::string why =
        etcd ? fmt::format("{}: {} (through {})", e.context().op, e.cause(), store_location(info))
             : fmt::format("{}: {} (is {}:{} served by a program other than this job's rank 0?)",
                           e.context().op, e.cause(), info.master_addr, info.master_port);
    if (dynamic_cast<const TimeoutError*>(&e)) throw TimeoutError(ctx, why);
    throw CommError(ctx, why);
  }
  return store;
}

CommunicatorPtr init_communicator(const LaunchInfo& info, const CommunicatorOptions& options) {
  info.validate();
  const CommunicatorOptions o = info.communicator_options(options);
  std::shared_ptr<Store> store =
      info.world_size == 1 ? make_memory_store() : connect_store(info, o.timeout);
  return make_communicator(std::move(store), info.rank, info.world_size, o);
}

}  // namespace dtrain

#include "dtrain/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "comm/store/socket.h"
#include "dtrain/errors.h"
#include "dtrain/etcd_store.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kDefaultJoinTimeout = std::chrono::seconds(300);

int64_t get_int(Store& store, const std::string& key) { return store.add(key, 0); }

// Where the store is, for messages.
std::string store_location(const LaunchInfo& info) {
  if (info.rdzv_backend == RendezvousBackend::kEtcd)
    return fmt::format("etcd {} (run '{}', generation {})", info.rdzv_endpoint, info.run_id,
                       info.generation);
  return fmt::format("{}:{}", info.master_addr, info.master_port);
}

// The lines a waiting rank prints: every 30 s, or every tenth of the join timeout when that
// is shorter (at least every second), so that a wrong MASTER_PORT or a rank that never
// started is visible long before the timeout.
class JoinProgress {
 public:
  JoinProgress(const LaunchInfo& info, milliseconds timeout)
      : info_(info),
        timeout_(timeout),
        interval_(std::clamp(timeout / 10, milliseconds(1000), milliseconds(30000))),
        start_(Clock::now()),
        next_(start_ + interval_) {}

  Clock::time_point next() const { return next_; }

  // Prints "waiting for <what>" when the next line is due.
  void say(const std::string& what) {
    const auto now = Clock::now();
    if (now < next_) return;
    while (next_ <= now) next_ += interval_;
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start_);
    fmt::print(stderr,
               "dtrain: rank {} of {} waiting for {} at {}, {} s of {:g} s (the join timeout: "
               "DTRAIN_JOIN_TIMEOUT or dtrain-run --join_timeout_s)\n",
               info_.rank, info_.world_size, what, store_location(info_), waited.count(),
               static_cast<double>(timeout_.count()) / 1000.0);
    std::fflush(stderr);
  }

 private:
  const LaunchInfo& info_;
  milliseconds timeout_;
  milliseconds interval_;
  Clock::time_point start_;
  Clock::time_point next_;
};

// Checks, through the store, that every rank of [0, world_size) is claimed by exactly one
// process and that all agree on world_size; a failure seen by one rank is published under
// "error" so that every rank fails with the same message instead of waiting out its timeout.
class LaunchCheck {
 public:
  LaunchCheck(std::shared_ptr<Store> store, const LaunchInfo& info, milliseconds timeout,
              JoinProgress& progress)
      : store_(make_prefix_store("dtrain/launch", std::move(store))),
        info_(info),
        timeout_(timeout),
        progress_(progress),
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
        throw TimeoutError(ctx_, fmt::format("only {} of {} ranks joined at {} within {} ms{}",
                                             joined, info_.world_size, store_location(info_),
                                             timeout_.count(), missing_ranks()));
      }
      // Rank 0 speaks for the job: every rank waiting alike would be one line per process.
      if (info_.rank == 0 && Clock::now() >= progress_.next()) {
        progress_.say(fmt::format("{} of {} ranks{}", info_.world_size - joined, info_.world_size,
                                  missing_ranks()));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
    }
  }

  // " (ranks 1, 3)": the ranks no process has claimed yet, up to 8 of them (none listed for
  // worlds above 1024, where asking is too many round trips).
  std::string missing_ranks() const {
    if (info_.world_size > 1024) return "";
    std::vector<std::string> missing;
    int more = 0;
    for (int r = 0; r < info_.world_size; ++r) {
      if (store_->check({fmt::format("claim/{}", r)})) continue;
      if (missing.size() < 8) {
        missing.push_back(std::to_string(r));
      } else {
        ++more;
      }
    }
    if (missing.empty()) return "";
    std::string list = missing[0];
    for (size_t i = 1; i < missing.size(); ++i) list += ", " + missing[i];
    if (more > 0) list += fmt::format(" and {} more", more);
    return fmt::format(" ({} {} not started or not reaching the store)",
                       missing.size() + more == 1 ? "rank" : "ranks", list);
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
  milliseconds timeout_;
  JoinProgress& progress_;
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

// Waits until rank 0's store accepts connections, saying so while it does not: the TCP
// store's own connect would wait silently for the whole timeout. Throws TimeoutError at the
// deadline.
void wait_for_master(const LaunchInfo& info, Clock::time_point deadline, JoinProgress& progress) {
  for (;;) {
    try {
      detail::connect_tcp(info.master_addr, static_cast<uint16_t>(info.master_port),
                          std::min(deadline, progress.next()));
      return;  // the probe closes; the store connects for real
    } catch (const std::exception& e) {
      if (Clock::now() >= deadline)
        throw TimeoutError(ErrorContext{-1, -1, "tcp_store.connect", -1}, e.what());
    }
    progress.say("the master (rank 0's store)");
  }
}

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

std::shared_ptr<Store> connect_store(const LaunchInfo& info,
                                     std::optional<milliseconds> program_timeout) {
  info.validate();
  const milliseconds timeout =
      info.join_timeout.value_or(program_timeout.value_or(kDefaultJoinTimeout));
  const bool etcd = info.rdzv_backend == RendezvousBackend::kEtcd;
  JoinProgress progress(info, timeout);
  std::shared_ptr<Store> store;
  try {
    if (!etcd && info.rank != 0) wait_for_master(info, Clock::now() + timeout, progress);
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
    LaunchCheck(store, info, timeout, progress).run();
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

// The agents' rendezvous store for dtrain-run --nnodes MIN:MAX: dtrain's TCP store at
// master_addr:master_port, served by the agent on that host; or etcd (--rdzv_backend etcd).
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/etcd_store.h"
#include "launcher/elastic.h"

namespace dtrain::launcher {
namespace {

// True when `host` is an address of this machine (something here can bind it).
bool is_local_host(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool local = false;
  for (addrinfo* a = found; a != nullptr && !local; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM, 0);
    if (fd < 0) continue;
    local = bind(fd, a->ai_addr, a->ai_addrlen) == 0;  // port 0: any free one
    close(fd);
  }
  freeaddrinfo(found);
  return local;
}

// The agents read their counters with add(key, 0) several times a second. On etcd an add is
// a compare-and-swap that writes (a raft commit and an fsync) even for 0: read instead.
class EtcdAgentStore : public Store {
 public:
  explicit EtcdAgentStore(std::shared_ptr<Store> etcd) : etcd_(std::move(etcd)) {}
  void set(const std::string& key, const Bytes& value) override { etcd_->set(key, value); }
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    return etcd_->get(key, timeout);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    if (delta != 0) return etcd_->add(key, delta);
    if (!etcd_->check({key})) return 0;
    const std::string v = etcd_->get_string(key, std::chrono::seconds(60));
    try {
      return std::stoll(v);
    } catch (const std::exception&) {
      throw std::runtime_error(
          fmt::format("rendezvous key '{}' holds '{}', not a counter", key, v));
    }
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    etcd_->wait(keys, timeout);
  }
  bool check(const std::vector<std::string>& keys) override { return etcd_->check(keys); }
  std::string network_address() const override { return etcd_->network_address(); }

 private:
  std::shared_ptr<Store> etcd_;
};

}  // namespace

std::shared_ptr<Store> make_agent_store(const std::string& host, int port, const std::string& token,
                                        bool& serves) {
  TcpStoreOptions so;
  so.host = host;
  so.port = static_cast<uint16_t>(port);
  so.token = token;
  so.timeout = std::chrono::seconds(60);
  serves = false;
  if (is_local_host(host)) {
    so.is_server = true;
    try {
      auto store = make_tcp_store(so);
      serves = true;
      return store;
    } catch (const CommError&) {
      // The port is taken: another agent of this host serves the store (else connecting
      // below fails with the reason).
    }
    so.is_server = false;
  }
  return make_tcp_store(so);
}

std::shared_ptr<Store> make_agent_etcd_store(const std::string& endpoints,
                                             const std::string& run_id) {
  EtcdStoreOptions eo;
  eo.endpoints = endpoints;
  eo.key_prefix = fmt::format("/dtrain/{}/agents/", run_id);
  eo.timeout = std::chrono::seconds(60);
  return std::make_shared<EtcdAgentStore>(make_etcd_store(eo));
}

}  // namespace dtrain::launcher

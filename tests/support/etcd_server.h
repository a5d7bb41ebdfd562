// A real etcd server for one test: free client and peer ports on 127.0.0.1, a data directory
// of its own, SIGKILLed and removed at scope exit (and killed by its parent-death signal if
// the test process dies first).
//
//   if (!testing::EtcdServer::installed()) GTEST_SKIP() << testing::EtcdServer::kMissing;
//   testing::EtcdServer etcd;
//   EtcdStoreOptions o;  o.endpoints = etcd.endpoint();  o.key_prefix = "/t/";
#pragma once

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "dtrain/etcd_store.h"
#include "launcher/spawn.h"
#include "support/temp_dir.h"

namespace dtrain::testing {

class EtcdServer {
 public:
  static constexpr const char* kMissing =
      "etcd is not installed (Debian: apt-get install etcd-server; scripts/install-deps.sh "
      "installs it): the etcd store tests need a real etcd server";

  // The etcd executable on PATH, or "" when there is none.
  static std::string executable() {
    const char* path = std::getenv("PATH");
    std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
    for (std::string dir; std::getline(dirs, dir, ':');) {
      const std::string candidate = (dir.empty() ? "." : dir) + "/etcd";
      struct stat st {};
      if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
          ::access(candidate.c_str(), X_OK) == 0)
        return candidate;
    }
    return {};
  }
  static bool installed() { return !executable().empty(); }

  EtcdServer() : dir_("etcd") {
    client_port_ = launcher::free_port();
    int peer = launcher::free_port();
    while (peer == client_port_) peer = launcher::free_port();
    const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
    const std::string peers = "http://127.0.0.1:" + std::to_string(peer);
    log_ = dir_ / "etcd.log";
    launcher::SpawnOptions so;
    so.stdout_path = so.stderr_path = log_;
    so.null_stdin = true;
    so.parent_death_signal = SIGKILL;
    const std::string exe = executable();
    pid_ = launcher::spawn_process(
        exe,
        {exe, "--name", "test", "--data-dir", dir_ / "data", "--listen-client-urls", client,
         "--advertise-client-urls", client, "--listen-peer-urls", peers,
         "--initial-advertise-peer-urls", peers, "--initial-cluster", "test=" + peers},
        // No ETCD_* variable of the caller's environment may reconfigure it.
        {"PATH=/usr/bin:/bin"}, so);
    // Ready when a store can talk to it (the store's connect retries until then).
    try {
      EtcdStoreOptions o;
      o.endpoints = endpoint();
      o.key_prefix = "/ready/";
      o.timeout = std::chrono::seconds(30);
      make_etcd_store(o);
    } catch (const std::exception& e) {
      stop();
      throw std::runtime_error(std::string("etcd did not start: ") + e.what() + "\n" + log());
    }
  }
  ~EtcdServer() { stop(); }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }
  int port() const { return client_port_; }

  // Kills the server now (a lost etcd host); idempotent.
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
  }

  std::string log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  TempDir dir_;
  std::string log_;
  int client_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace dtrain::testing

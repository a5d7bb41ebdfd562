// The TCP store against clients that misbehave: each test runs a real server and talks to it
// through raw sockets where the store's own client would not send the bad input.
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "comm/net/address.h"
#include "comm/store/protocol.h"
#include "comm/store/socket.h"
#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"
#include "dtrain/store.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

namespace proto = store_protocol;
using detail::Clock;
using std::chrono::milliseconds;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TcpStoreOptions server_options() {
  TcpStoreOptions o;
  o.port = static_cast<uint16_t>(testing::free_port());
  o.is_server = true;
  o.timeout = milliseconds(5000);
  return o;
}

// A server with small bounds, so that oversized frames, keys and values are cheap to send.
TcpStoreOptions small_bounds() {
  TcpStoreOptions o = server_options();
  o.max_key_bytes = 64;
  o.max_value_bytes = 1024;
  o.max_unread_reply_bytes = 4096;
  return o;
}

TcpStoreOptions client_of(TcpStoreOptions o) {
  o.is_server = false;
  return o;
}

// A client speaking the wire protocol by hand.
class RawClient {
 public:
  // rcvbuf > 0: a receive buffer that small, so that unread replies back up on the server.
  explicit RawClient(uint16_t port, int rcvbuf = 0)
      : socket_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    if (rcvbuf > 0) ::setsockopt(socket_.fd(), SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(socket_.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      throw std::system_error(errno, std::generic_category(), "connect");
    }
  }

  void send(const std::string& bytes) {
    detail::send_all(socket_.fd(), bytes.data(), bytes.size(), Clock::now() + milliseconds(5000));
  }

  // The next reply (status, payload), or nothing when the server closed or `timeout` passed.
  std::optional<std::pair<uint8_t, std::string>> reply(milliseconds timeout = milliseconds(5000)) {
    char len_buf[4];
    if (!read(len_buf, 4, timeout)) return std::nullopt;
    std::string body(proto::read_u32(len_buf), '\0');
    if (body.empty() || !read(body.data(), body.size(), timeout)) return std::nullopt;
    return std::make_pair(static_cast<uint8_t>(body[0]), body.substr(1));
  }

  void hello(const std::string& token = "") {
    send(proto::encode_hello(token));
    auto r = reply();
    if (!r || r->first != proto::kOk) throw std::runtime_error("handshake failed");
  }

  // True when the server ends the connection within `timeout` (whatever it sent first).
  bool closed_within(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    char buf[65536];
    while (Clock::now() < deadline) {
      pollfd p{socket_.fd(), POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t k = ::recv(socket_.fd(), buf, sizeof(buf), MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno == ECONNRESET)) return true;
    }
    return false;
  }

  int fd() const { return socket_.fd(); }

 private:
  bool read(char* p, size_t n, milliseconds timeout) {
    try {
      detail::recv_all(socket_.fd(), p, n, Clock::now() + timeout);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  detail::Socket socket_;
};

// Set, get and add through `store` work, each within a second.
void expect_serving(Store& store, const std::string& tag) {
  const auto t = Clock::now();
  store.set("alive/" + tag, std::string("yes"));
  EXPECT_EQ(store.get_string("alive/" + tag, milliseconds(1000)), "yes");
  EXPECT_GE(store.add("alive/n", 1), 1);
  EXPECT_LT(seconds_since(t), 1.0) << tag;
}

TEST(StoreHostile, AddOnANonNumberFailsThatCallAndTheServerKeepsServing) {
  TcpStoreOptions o = server_options();
  auto server = make_tcp_store(o);
  auto a = make_tcp_store(client_of(o));
  auto b = make_tcp_store(client_of(o));
  a->set("k", std::string("abc"));
  try {
    a->add("k", 1);
    FAIL() << "add on a non-number succeeded";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.cause(), fmt::format("key 'k' at 127.0.0.1:{}: add: key 'k' holds 3 bytes that "
                                     "are not a decimal integer (set by store.set?)",
                                     o.port));
  }
  expect_serving(*a, "a");  // the failing client's connection too
  expect_serving(*b, "b");
  expect_serving(*server, "server");
}

TEST(StoreHostile, OversizedFrameIsRefusedAndClosesOnlyThatClient) {
  TcpStoreOptions o = small_bounds();
  auto server = make_tcp_store(o);
  RawClient raw(o.port);
  raw.hello();
  for (uint32_t len : {1024u + 64u + 6u, 1u << 31}) {
    RawClient c(o.port);
    c.hello();
    std::string header(4, '\0');
    std::memcpy(header.data(), &len, 4);
    c.send(header);
    auto r = c.reply();
    ASSERT_TRUE(r.has_value()) << "no reply to a frame header of " << len << " bytes";
    EXPECT_EQ(r->first, proto::kRefused);
    EXPECT_EQ(r->second, fmt::format("frame of {} bytes exceeds the bound of 1093 bytes "
                                     "(max_key_bytes + max_value_bytes + 5)",
                                     len));
    EXPECT_TRUE(c.closed_within(milliseconds(3000)));
  }
  raw.send(proto::encode_set("k", "v"));
  EXPECT_EQ(raw.reply()->first, proto::kOk);
  expect_serving(*server, "server");
}

TEST(StoreHostile, OversizedKeyOrValueIsAnErrorReplyAndTheClientGoesOn) {
  TcpStoreOptions o = small_bounds();
  auto server = make_tcp_store(o);
  RawClient raw(o.port);
  raw.hello();
  raw.send(proto::encode_set("k", std::string(1025, 'v')));
  auto r = raw.reply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->first, proto::kBadRequest);
  EXPECT_EQ(r->second, "set: value of 1025 bytes exceeds max_value_bytes=1024");
  raw.send(proto::encode_get(std::string(65, 'k')));
  r = raw.reply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->second, "get: key of 65 bytes exceeds max_key_bytes=64");
  raw.send(proto::encode_set("k", std::string(1024, 'v')));
  EXPECT_EQ(raw.reply()->first, proto::kOk);

  // The store's own client refuses before sending.
  auto client = make_tcp_store(client_of(o));
  try {
    client->set(std::string(65, 'k'), std::string("v"));
    FAIL() << "a key over max_key_bytes was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.cause(), "set: key of 65 bytes exceeds max_key_bytes=64");
  }
  EXPECT_THROW(client->set("k", Bytes(1025)), InvalidArgument);
  EXPECT_EQ(client->get("k", milliseconds(1000)).size(), 1024u);
}

TEST(StoreHostile, UnknownAndMalformedRequestsGetErrorReplies) {
  TcpStoreOptions o = server_options();
  auto server = make_tcp_store(o);
  RawClient raw(o.port);
  raw.hello();
  raw.send(std::string("\x01\0\0\0\x09", 5));
  EXPECT_EQ(raw.reply()->second, "unknown command 9");
  raw.send(std::string("\x06\0\0\0\x01\x63\0\0\0k", 10));
  EXPECT_EQ(raw.reply()->second, "set: malformed request");
  raw.send(proto::encode_add("n", 2));
  auto r = raw.reply();
  ASSERT_EQ(r->first, proto::kOk);
  EXPECT_EQ(proto::read_i64(r->second.data()), 2);
  expect_serving(*server, "server");
}

TEST(StoreHostile, TooManyClientsRefusesTheExtraOneAndKeepsTheOthers) {
  TcpStoreOptions o = server_options();
  o.max_clients = 3;  // the server's own client is one of them
  auto server = make_tcp_store(o);
  auto a = make_tcp_store(client_of(o));
  auto b = make_tcp_store(client_of(o));
  try {
    make_tcp_store(client_of(o));
    FAIL() << "a client beyond max_clients was admitted";
  } catch (const CommError& e) {
    EXPECT_EQ(e.cause(), fmt::format("store at 127.0.0.1:{} refused this process: too many clients "
                                     "(max_clients=3)",
                                     o.port));
  }
  expect_serving(*a, "a");
  expect_serving(*b, "b");
  expect_serving(*server, "server");
  b.reset();  // frees a slot
  std::this_thread::sleep_for(milliseconds(200));
  auto c = make_tcp_store(client_of(o));
  expect_serving(*c, "c");
}

TEST(StoreHostile, ClientThatNeverReadsItsReplyDoesNotStallOthers) {
  TcpStoreOptions o = server_options();
  o.max_value_bytes = 8u << 20;
  o.max_unread_reply_bytes = 17u << 20;
  auto server = make_tcp_store(o);
  server->set("big", Bytes(8u << 20, 7));
  RawClient slow(o.port, /*rcvbuf=*/4096);
  slow.hello();
  // 16 MiB, under the bound, that neither its small window nor the server's socket buffer
  // (at most tcp_wmem's 4 MiB) can take: the rest waits in the server's output buffer.
  slow.send(proto::encode_get("big") + proto::encode_get("big"));
  std::this_thread::sleep_for(milliseconds(200));

  TcpStoreOptions co = client_of(o);
  co.timeout = milliseconds(3000);
  auto other = make_tcp_store(co);
  const auto t = Clock::now();
  for (int i = 0; i < 20; ++i) expect_serving(*other, std::to_string(i));
  EXPECT_EQ(other->get("big", milliseconds(3000)).size(), 8u << 20);
  EXPECT_LT(seconds_since(t), 3.0);
  // Under the bound it is only slow, not dropped: its replies are still there when it reads.
  for (int i = 0; i < 2; ++i) {
    auto r = slow.reply();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->second.size(), 1u + (8u << 20));
  }
}

TEST(StoreHostile, ClientWithTooManyUnreadRepliesIsDropped) {
  TcpStoreOptions o = server_options();
  o.max_value_bytes = 1u << 20;
  o.max_unread_reply_bytes = 2u << 20;
  auto server = make_tcp_store(o);
  server->set("big", Bytes(1u << 20, 7));
  RawClient greedy(o.port);
  greedy.hello();
  std::string requests;
  for (int i = 0; i < 200; ++i) requests += proto::encode_get("big");  // 200 MiB of replies
  greedy.send(requests);
  EXPECT_TRUE(greedy.closed_within(milliseconds(5000)));
  expect_serving(*server, "server");
}

TEST(StoreHostile, WrongOrMissingTokenIsRefusedAndTheRightOneAccepted) {
  TcpStoreOptions o = server_options();
  o.token = "job-7f3a";
  auto server = make_tcp_store(o);
  const std::string refusal = fmt::format(
      "store at 127.0.0.1:{} refused this process: wrong or missing DTRAIN_STORE_TOKEN", o.port);
  for (const char* token : {"", "job-7f3b", "job-7f3a-", "job"}) {
    TcpStoreOptions co = client_of(o);
    co.token = token;
    try {
      make_tcp_store(co);
      FAIL() << "token '" << token << "' was accepted";
    } catch (const CommError& e) {
      EXPECT_EQ(e.cause(), refusal) << token;
      EXPECT_EQ(e.context().op, "tcp_store.connect");
    }
  }
  RawClient raw(o.port);
  raw.send(proto::encode_hello("wrong"));
  auto r = raw.reply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->first, proto::kRefused);
  EXPECT_TRUE(raw.closed_within(milliseconds(3000)));  // the server closes it

  auto good = make_tcp_store(client_of(o));
  expect_serving(*good, "good");
  expect_serving(*server, "server");
}

TEST(StoreHostile, SilentOrForeignConnectionsAreClosed) {
  TcpStoreOptions o = server_options();
  o.handshake_timeout = milliseconds(300);
  auto server = make_tcp_store(o);
  RawClient silent(o.port);
  RawClient http(o.port);
  http.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  auto r = http.reply();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->second, "not a dtrain store client (bad handshake)");
  EXPECT_TRUE(http.closed_within(milliseconds(3000)));
  expect_serving(*server, "server");
  const auto t = Clock::now();
  EXPECT_TRUE(silent.closed_within(milliseconds(3000)));
  EXPECT_LT(seconds_since(t), 1.5);
}

TEST(StoreHostile, ConnectStoreCarriesTheTokenFromTheEnvironment) {
  const int port = testing::free_port();
  auto env = [&](int rank, const std::string& token) {
    std::map<std::string, std::string> e = testing::rank_env(rank, 2, port);
    e["DTRAIN_STORE_TOKEN"] = token;
    return LaunchInfo::from_env(e);
  };
  EXPECT_EQ(env(0, "abc").store_token, "abc");
  EXPECT_THROW(env(0, std::string(1025, 't')), InvalidArgument);
  std::shared_ptr<Store> s0;
  std::string rank0_error;
  std::thread rank0([&] {
    try {
      s0 = connect_store(env(0, "abc"), milliseconds(10000));
    } catch (const std::exception& e) {
      rank0_error = e.what();
    }
  });
  std::this_thread::sleep_for(milliseconds(300));
  try {
    connect_store(env(1, "abd"), milliseconds(3000));
    ADD_FAILURE() << "a rank with the wrong token joined";
  } catch (const CommError& e) {
    EXPECT_NE(e.cause().find("refused this process: wrong or missing DTRAIN_STORE_TOKEN"),
              std::string::npos)
        << e.what();
  }
  auto s1 = connect_store(env(1, "abc"), milliseconds(10000));
  rank0.join();
  EXPECT_TRUE(s0 != nullptr) << rank0_error;
}

TEST(StoreHostile, InconsistentOptionsAreRefusedUpFront) {
  const auto cause = [](TcpStoreOptions o) {
    try {
      make_tcp_store(o);
    } catch (const InvalidArgument& e) {
      return e.cause();
    }
    return std::string("(accepted)");
  };
  TcpStoreOptions o = server_options();
  o.token = std::string(1025, 't');
  EXPECT_EQ(cause(o), "token (DTRAIN_STORE_TOKEN) of 1025 bytes; at most 1024");
  o = server_options();
  o.max_unread_reply_bytes = o.max_value_bytes;
  EXPECT_EQ(cause(o),
            "max_unread_reply_bytes=4194304 is below one reply to a get (max_value_bytes + 16 = "
            "4194320)");
  o = server_options();
  o.max_clients = 0;
  EXPECT_EQ(cause(o), "max_clients must be >= 1");
}

// A server that answers the handshake, then stops answering: the client's call times out,
// and later calls fail at once instead of reading the late reply as their own.
TEST(StoreHostile, TimedOutExchangeBreaksTheClient) {
  uint16_t port = 0;
  detail::Socket listener = detail::listen_tcp("127.0.0.1", 0, &port);
  std::thread fake([&] {
    detail::Socket c(::accept(listener.fd(), nullptr, nullptr));
    char buf[256];
    (void)!::recv(c.fd(), buf, sizeof(buf), 0);  // the hello
    std::string ok;
    proto::put_reply(ok, proto::kOk, {});
    detail::send_all(c.fd(), ok.data(), ok.size(), Clock::now() + milliseconds(1000));
    while (::recv(c.fd(), buf, sizeof(buf), 0) > 0) {
    }
  });
  TcpStoreOptions o;
  o.port = port;
  o.timeout = milliseconds(300);
  {
    auto client = make_tcp_store(o);
    EXPECT_THROW(client->add("n", 1), TimeoutError);
    try {
      client->add("n", 1);
      ADD_FAILURE() << "a call after a timed-out exchange was sent";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "a second timeout instead of a broken store: " << e.what();
    } catch (const CommError& e) {
      EXPECT_NE(e.cause().find("store connection broken by an earlier failure"), std::string::npos)
          << e.what();
    }
  }
  fake.join();
}

// Binding follows the listening-address rule (docs/multinode.md): the master's address only.
TEST(StoreHostile, ServerListensOnTheMasterAddressOnly) {
  std::vector<std::string> hosts = {"127.0.0.2"};
  const std::string external = net::first_external_address();
  if (!external.empty() && external.find(':') == std::string::npos) hosts.push_back(external);
  for (const std::string& host : hosts) {
    TcpStoreOptions o = server_options();
    o.host = host;
    auto server = make_tcp_store(o);
    EXPECT_THROW(detail::connect_tcp("127.0.0.1", o.port, Clock::now() + milliseconds(300)),
                 std::exception)
        << "a store for " << host << " is reachable on 127.0.0.1";
    expect_serving(*make_tcp_store(client_of(o)), host);
  }
}

// Thread id of this process's thread named `name`, or -1.
int thread_named(const std::string& name) {
  DIR* d = ::opendir("/proc/self/task");
  int found = -1;
  while (dirent* e = d ? ::readdir(d) : nullptr) {
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string n;
    if (std::getline(comm, n) && n == name) found = std::atoi(e->d_name);
  }
  if (d) ::closedir(d);
  return found;
}

// utime + stime of the thread whose stat file is open as `fd`, in clock ticks.
long cpu_ticks(int fd) {
  char buf[1024] = {0};
  const ssize_t k = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (k <= 0) return -1;
  const char* p = std::strrchr(buf, ')');  // the name may hold spaces
  long utime = 0, stime = 0;
  // Fields after ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
  // utime stime.
  if (!p || std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld", &utime,
                        &stime) != 2) {
    return -1;
  }
  return utime + stime;
}

// Run in a child process by the test below: it lowers this process's RLIMIT_NOFILE.
TEST(StoreHostile, DISABLED_ChildAcceptWithoutFileDescriptors) {
  TcpStoreOptions o = server_options();
  auto server = make_tcp_store(o);
  const int tid = thread_named("dtrain-store");
  ASSERT_GT(tid, 0);
  const int stat = ::open(fmt::format("/proc/self/task/{}/stat", tid).c_str(), O_RDONLY);
  ASSERT_GE(stat, 0);
  detail::Socket pending(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  // No descriptor can be created from here on: the server's accept fails with EMFILE while
  // the connection below waits in its backlog.
  const int lowest_free = ::dup(0);
  ::close(lowest_free);
  rlimit old{};
  ::getrlimit(RLIMIT_NOFILE, &old);
  rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(o.port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(pending.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const long before = cpu_ticks(stat);
  std::this_thread::sleep_for(milliseconds(1500));
  const long used = cpu_ticks(stat) - before;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  std::printf("store thread used %ld ticks of %ld per second over 1.5 s without descriptors\n",
              used, ::sysconf(_SC_CLK_TCK));
  EXPECT_GE(before, 0);
  EXPECT_LT(used, ::sysconf(_SC_CLK_TCK) / 10);  // under 0.1 s of CPU; spinning takes ~1.5 s
  // Once descriptors are back, the waiting client is served (within the 1 s back-off cap).
  const std::string hello = proto::encode_hello("");
  detail::send_all(pending.fd(), hello.data(), hello.size(), Clock::now() + milliseconds(3000));
  char reply[5];
  detail::recv_all(pending.fd(), reply, 5, Clock::now() + milliseconds(3000));
  EXPECT_EQ(reply[4], proto::kOk);
  expect_serving(*server, "server");
  ::close(stat);
}

TEST(StoreHostile, AcceptFailuresBackOffInsteadOfSpinning) {
  char self[PATH_MAX] = {0};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  auto p = testing::spawn_process(
      {self, "--gtest_also_run_disabled_tests",
       "--gtest_filter=StoreHostile.DISABLED_ChildAcceptWithoutFileDescriptors"},
      {{"OMP_NUM_THREADS", "1"}});
  const auto r = testing::wait_process(p, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace dtrain

// The etcd store beyond the conformance tests every store passes (store_test.cpp): its
// codecs, its options, its HTTP client against a scripted server, and its failures against
// a real etcd server that goes away.
#include <gtest/gtest.h>

#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "comm/store/etcd_http.h"
#include "comm/store/socket.h"
#include "dtrain/errors.h"
#include "dtrain/etcd_store.h"
#include "support/etcd_server.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(EtcdCodec, Base64RoundTripsAndRefusesGarbage) {
  EXPECT_EQ(detail::base64_encode(""), "");
  EXPECT_EQ(detail::base64_encode("f"), "Zg==");
  EXPECT_EQ(detail::base64_encode("fo"), "Zm8=");
  EXPECT_EQ(detail::base64_encode("foo"), "Zm9v");
  EXPECT_EQ(detail::base64_encode("foob"), "Zm9vYg==");
  std::string every_byte;
  for (int i = 0; i < 256; ++i) every_byte += static_cast<char>(i);
  for (size_t n = 0; n <= every_byte.size(); n += 37) {
    const std::string s = every_byte.substr(0, n);
    EXPECT_EQ(detail::base64_decode(detail::base64_encode(s)), s) << n;
  }
  EXPECT_THROW(detail::base64_decode("Zm9"), std::invalid_argument);       // length
  EXPECT_THROW(detail::base64_decode("Zm9*"), std::invalid_argument);      // alphabet
  EXPECT_THROW(detail::base64_decode("Z==="), std::invalid_argument);      // too much padding
  EXPECT_THROW(detail::base64_decode("Zg==Zm9v"), std::invalid_argument);  // padding inside
}

TEST(EtcdCodec, EndpointsParse) {
  auto e = detail::parse_etcd_endpoints("10.0.0.1:2379, http://etcd-b:2380/,[::1]:2381");
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].host, "10.0.0.1");
  EXPECT_EQ(e[0].port, 2379);
  EXPECT_EQ(e[1].host, "etcd-b");
  EXPECT_EQ(e[1].port, 2380);
  EXPECT_EQ(e[2].host, "::1");
  EXPECT_EQ(e[2].text(), "[::1]:2381");
  for (const char* bad : {"", "host", "host:", ":2379", "host:0", "host:65536", "host:12x",
                          "https://host:2379", "a:1,", "::1:2379"}) {
    EXPECT_THROW(detail::parse_etcd_endpoints(bad), std::invalid_argument) << bad;
  }
}

TEST(EtcdStore, OptionsAreChecked) {
  EtcdStoreOptions o;
  o.endpoints = "127.0.0.1:2379";
  o.key_prefix = "";
  EXPECT_THROW(make_etcd_store(o), InvalidArgument);
  o.key_prefix = "/p/";
  o.timeout = milliseconds(0);
  EXPECT_THROW(make_etcd_store(o), InvalidArgument);
  o.timeout = milliseconds(1000);
  o.endpoints = "https://127.0.0.1:2379";
  try {
    make_etcd_store(o);
    FAIL() << "https endpoint accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("https"), std::string::npos) << e.what();
  }
}

TEST(EtcdStore, UnreachableServerTimesOutNamingTheEndpoint) {
  EtcdStoreOptions o;
  const int port = testing::free_port();
  o.endpoints = "127.0.0.1:" + std::to_string(port);
  o.key_prefix = "/p/";
  o.timeout = milliseconds(800);
  const auto start = Clock::now();
  try {
    make_etcd_store(o);
    FAIL() << "no etcd there, yet the store was made";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find(o.endpoints), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("etcd_store.connect"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 2 * 0.8 + 1.0);
}

// What a scripted server sends back, and whether it then closes the connection.
struct Reply {
  Reply(std::string b, bool c = false) : bytes(std::move(b)), close(c) {}  // NOLINT
  std::string bytes;
  bool close;
};

// A scripted HTTP server on 127.0.0.1: answers each request with handler(path, body), one
// connection at a time, until destroyed.
class FakeHttp {
 public:
  using Handler = std::function<Reply(const std::string& path, const std::string& body)>;
  explicit FakeHttp(Handler handler) : handler_(std::move(handler)) {
    uint16_t port = 0;
    listener_ = detail::listen_tcp("127.0.0.1", 0, &port);
    port_ = port;
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeHttp() {
    stop_ = true;
    thread_.join();
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  bool readable(int fd) {
    for (;;) {
      if (stop_) return false;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) return true;
    }
  }
  void serve() {
    while (readable(listener_.fd())) {
      detail::Socket c(::accept(listener_.fd(), nullptr, nullptr));
      if (c.fd() < 0) continue;
      std::string in;
      for (;;) {
        const size_t end = in.find("\r\n\r\n");
        if (end != std::string::npos) {
          const size_t cl = in.find("Content-Length: ");
          const size_t length = cl < end ? std::stoul(in.substr(cl + 16)) : 0;
          if (in.size() >= end + 4 + length) {
            const std::string path = in.substr(5, in.find(' ', 5) - 5);
            const Reply reply = handler_(path, in.substr(end + 4, length));
            in.erase(0, end + 4 + length);
            detail::send_all(c.fd(), reply.bytes.data(), reply.bytes.size(),
                             Clock::now() + std::chrono::seconds(5));
            if (reply.close) break;
            continue;
          }
        }
        if (!readable(c.fd())) return;
        char buf[4096];
        const ssize_t k = ::recv(c.fd(), buf, sizeof(buf), 0);
        if (k <= 0) break;
        in.append(buf, static_cast<size_t>(k));
      }
    }
  }

  Handler handler_;
  detail::Socket listener_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::string http(int status, const std::string& body, bool chunked = false) {
  std::string head =
      "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Type: application/json\r\n";
  if (!chunked) return head + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  // Two chunks, sizes in hex with an extension, then a trailer.
  const std::string a = body.substr(0, body.size() / 2), b = body.substr(body.size() / 2);
  char sizes[64];
  std::snprintf(sizes, sizeof(sizes), "%zx;ext=1\r\n", a.size());
  std::string out = head + "Transfer-Encoding: chunked\r\n\r\n" + sizes + a + "\r\n";
  std::snprintf(sizes, sizeof(sizes), "%zX\r\n", b.size());
  return out + sizes + b + "\r\n0\r\nX-Trailer: 1\r\n\r\n";
}

TEST(EtcdStore, ChunkedAndInterimResponsesAreRead) {
  FakeHttp server([](const std::string& path, const std::string&) -> Reply {
    if (path == "/v3/maintenance/status")
      return "HTTP/1.1 100 Continue\r\n\r\n" + http(200, R"({"version":"3.4.23"})", true);
    if (path == "/v3/kv/range")  // "value" for key "/p/k"
      return http(200, R"({"kvs":[{"key":"L3Avaw==","mod_revision":"7","value":"dmFsdWU="}]})",
                  true);
    return http(404, "Not Found");
  });
  EtcdStoreOptions o;
  o.endpoints = server.endpoint();
  o.key_prefix = "/p/";
  o.timeout = milliseconds(3000);
  auto store = make_etcd_store(o);
  EXPECT_EQ(store->get_string("k", milliseconds(1000)), "value");
}

TEST(EtcdStore, SomethingOtherThanEtcdIsNamed) {
  FakeHttp server(
      [](const std::string&, const std::string&) -> Reply { return http(404, "Not Found"); });
  EtcdStoreOptions o;
  o.endpoints = server.endpoint();
  o.key_prefix = "/p/";
  o.timeout = milliseconds(3000);
  try {
    make_etcd_store(o);
    FAIL() << "a 404 server was taken for etcd";
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("HTTP 404"), std::string::npos) << what;
    EXPECT_NE(what.find("etcd v3 client URL"), std::string::npos) << what;
    EXPECT_NE(what.find(o.endpoints), std::string::npos) << what;
  }
}

TEST(EtcdStore, ErrorAnswersBecomeCommErrorsWithEtcdsMessage) {
  std::atomic<int> txns{0};
  FakeHttp server([&](const std::string& path, const std::string&) -> Reply {
    if (path == "/v3/maintenance/status") return http(200, R"({"version":"3.4.23"})");
    ++txns;
    return http(400, R"({"error":"etcdserver: request is too large","code":3})");
  });
  EtcdStoreOptions o;
  o.endpoints = server.endpoint();
  o.key_prefix = "/p/";
  o.timeout = milliseconds(3000);
  auto store = make_etcd_store(o);
  try {
    store->set("big", std::string(100, 'x'));
    FAIL() << "an error answer was taken for success";
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("store.set"), std::string::npos) << what;
    EXPECT_NE(what.find("key 'big'"), std::string::npos) << what;
    EXPECT_NE(what.find("request is too large"), std::string::npos) << what;
    EXPECT_NE(what.find("--max-request-bytes"), std::string::npos) << what;
  }
  EXPECT_EQ(txns.load(), 1);  // not retried: it would fail the same way
}

// A lost answer to add's transaction may have been applied: add must fail rather than retry
// (and maybe count twice); an idempotent get simply asks again.
TEST(EtcdStore, AddWhoseAnswerIsLostFailsInsteadOfCountingTwice) {
  std::atomic<int> txns{0};
  FakeHttp server([&](const std::string& path, const std::string&) -> Reply {
    if (path == "/v3/maintenance/status") return http(200, R"({"version":"3.4.23"})");
    if (path == "/v3/kv/txn") {
      ++txns;
      return Reply("HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{", /*close=*/true);
    }
    return http(200, "{}");
  });
  EtcdStoreOptions o;
  o.endpoints = server.endpoint();
  o.key_prefix = "/p/";
  o.timeout = milliseconds(3000);
  auto store = make_etcd_store(o);
  try {
    store->add("n", 1);
    FAIL() << "a lost answer was taken for a count";
  } catch (const TimeoutError& e) {
    FAIL() << "add retried until its timeout: " << e.what();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown"), std::string::npos) << e.what();
  }
  EXPECT_EQ(txns.load(), 1);
}

TEST(EtcdStore, KeysLiveUnderThePrefix) {
  if (!testing::EtcdServer::installed()) GTEST_SKIP() << testing::EtcdServer::kMissing;
  testing::EtcdServer etcd;
  EtcdStoreOptions o;
  o.endpoints = "http://" + etcd.endpoint();
  o.timeout = milliseconds(5000);
  o.key_prefix = "/dtrain/run-a/";
  auto a = make_etcd_store(o);
  o.key_prefix = "/dtrain/run-b/";
  auto b = make_etcd_store(o);
  o.key_prefix = "/dtrain/";
  auto root = make_etcd_store(o);
  a->set("x", std::string("1"));
  EXPECT_FALSE(b->check({"x"}));
  EXPECT_TRUE(root->check({"run-a/x"}));
  EXPECT_EQ(b->add("x", 5), 5);
  EXPECT_EQ(a->get_string("x", milliseconds(1000)), "1");
  EXPECT_EQ(a->network_address(), "127.0.0.1");
}

// Losing etcd itself: every call fails within its bound, naming the call, the key and etcd.
TEST(EtcdStore, LostServerFailsEveryCallWithinItsTimeout) {
  if (!testing::EtcdServer::installed()) GTEST_SKIP() << testing::EtcdServer::kMissing;
  testing::EtcdServer etcd;
  EtcdStoreOptions o;
  o.endpoints = etcd.endpoint();
  o.key_prefix = "/lost/";
  o.timeout = milliseconds(1000);
  auto store = make_etcd_store(o);
  store->set("k", std::string("v"));
  etcd.stop();
  auto expect_timeout = [&](const char* op, const std::function<void()>& call, double bound_s) {
    const auto start = Clock::now();
    try {
      call();
      ADD_FAILURE() << op << " succeeded without etcd";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(op), std::string::npos) << what;
      EXPECT_NE(what.find(etcd.endpoint()), std::string::npos) << what;
    }
    EXPECT_LT(seconds_since(start), bound_s) << op;
  };
  expect_timeout(
      "store.set", [&] { store->set("k", std::string("w")); }, 2 * 1.0 + 1.0);
  expect_timeout(
      "store.add", [&] { store->add("n", 1); }, 2 * 1.0 + 1.0);
  expect_timeout(
      "store.check", [&] { store->check({"k"}); }, 2 * 1.0 + 1.0);
  expect_timeout(
      "store.get", [&] { store->get("k", milliseconds(300)); }, 2 * 1.0 + 1.0);
  expect_timeout(
      "store.wait", [&] { store->wait({"k"}, milliseconds(300)); }, 2 * 1.0 + 1.0);
}

}  // namespace
}  // namespace dtrain

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "dtrain/errors.h"
#include "dtrain/store.h"
#include "support/ranks.h"

namespace dtrain {
namespace {

using std::chrono::milliseconds;

void exercise(Store& a, Store& b) {
  a.set("k", std::string("v1"));
  EXPECT_EQ(b.get_string("k", milliseconds(1000)), "v1");
  b.set("k", std::string("v2"));
  EXPECT_EQ(a.get_string("k", milliseconds(1000)), "v2");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 3), 5);
  EXPECT_TRUE(a.check({"k", "n"}));
  EXPECT_FALSE(a.check({"k", "absent"}));

  // A get that waits for a later set.
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    b.set("late", Bytes{1, 2, 3});
  });
  EXPECT_EQ(a.get("late", milliseconds(5000)), (Bytes{1, 2, 3}));
  setter.join();

  auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(a.get("never", milliseconds(300)), TimeoutError);
  EXPECT_THROW(a.wait({"k", "never"}, milliseconds(300)), TimeoutError);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 2 * 0.6 + 0.5);
}

TEST(Store, Memory) {
  auto s = make_memory_store();
  exercise(*s, *s);
}

TEST(Store, PrefixIsolatesKeys) {
  auto base = make_memory_store();
  auto a = make_prefix_store("a", base);
  auto b = make_prefix_store("b", base);
  a->set("x", std::string("1"));
  EXPECT_FALSE(b->check({"x"}));
  EXPECT_TRUE(base->check({"a/x"}));
  exercise(*a, *a);
}

TEST(Store, TcpServerAndClient) {
  TcpStoreOptions o;
  o.port = static_cast<uint16_t>(testing::free_port());
  o.is_server = true;
  o.timeout = milliseconds(5000);
  auto server = make_tcp_store(o);
  o.is_server = false;
  auto client = make_tcp_store(o);
  exercise(*server, *client);
}

// Communicators listen on the store's network address: the local end of the connection to
// the server, so loopback for a loopback master, and nothing for in-process stores.
TEST(Store, NetworkAddressIsTheLocalEndOfTheServerConnection) {
  TcpStoreOptions o;
  o.port = static_cast<uint16_t>(testing::free_port());
  o.is_server = true;
  o.timeout = milliseconds(5000);
  auto server = make_tcp_store(o);
  EXPECT_EQ(server->network_address(), "127.0.0.1");
  EXPECT_EQ(make_prefix_store("p", server)->network_address(), "127.0.0.1");
  EXPECT_EQ(make_memory_store()->network_address(), "");
}

TEST(Store, TcpClientWithoutServerTimesOut) {
  TcpStoreOptions o;
  o.port = static_cast<uint16_t>(testing::free_port());
  o.timeout = milliseconds(1000);
  auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(make_tcp_store(o), Error);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 2 * 1.0 + 1.0);
}

}  // namespace
}  // namespace dtrain

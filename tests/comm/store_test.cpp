#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <stdexcept>
#include <thread>

#include "dtrain/errors.h"
#include "dtrain/etcd_store.h"
#include "dtrain/store.h"
#include "support/etcd_server.h"
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

// Every store implementation passes the same conformance tests: two clients of one store
// (the same object for in-process stores), and whatever keeps the store alive.
struct StorePair {
  std::shared_ptr<void> keep;  // first: destroyed after the clients
  std::shared_ptr<Store> a, b;
};

StorePair make_pair(const std::string& kind) {
  StorePair p;
  if (kind == "memory") {
    p.a = p.b = make_memory_store();
  } else if (kind == "prefix") {
    p.a = p.b = make_prefix_store("p", make_memory_store());
  } else if (kind == "tcp") {
    TcpStoreOptions o;
    o.port = static_cast<uint16_t>(testing::free_port());
    o.is_server = true;
    o.timeout = milliseconds(5000);
    p.a = make_tcp_store(o);
    o.is_server = false;
    p.b = make_tcp_store(o);
  } else if (kind == "etcd") {
    auto etcd = std::make_shared<testing::EtcdServer>();
    EtcdStoreOptions o;
    o.endpoints = etcd->endpoint();
    o.key_prefix = "/dtrain/store_test/";
    o.timeout = milliseconds(5000);
    p.keep = etcd;
    p.a = make_etcd_store(o);
    p.b = make_etcd_store(o);
  } else {
    throw std::logic_error("unknown store kind " + kind);
  }
  return p;
}

class StoreConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "etcd" && !testing::EtcdServer::installed())
      GTEST_SKIP() << testing::EtcdServer::kMissing;
    stores_ = make_pair(GetParam());
  }
  StorePair stores_;
};

TEST_P(StoreConformance, SetGetAddCheckWait) { exercise(*stores_.a, *stores_.b); }

TEST_P(StoreConformance, ConcurrentAddsAreAtomic) {
  constexpr int kThreads = 4, kAdds = 25;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Store& s = t % 2 == 0 ? *stores_.a : *stores_.b;
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(s.add("counter", 1));
    });
  }
  for (auto& t : threads) t.join();
  std::set<int64_t> all;
  for (const auto& v : seen) all.insert(v.begin(), v.end());
  // Every add saw a different total: none was lost or counted twice.
  EXPECT_EQ(all.size(), static_cast<size_t>(kThreads * kAdds));
  EXPECT_EQ(*all.begin(), 1);
  EXPECT_EQ(*all.rbegin(), kThreads * kAdds);
  EXPECT_EQ(stores_.b->add("counter", 0), kThreads * kAdds);
  EXPECT_EQ(stores_.a->add("counter", -kThreads * kAdds), 0);
}

TEST_P(StoreConformance, BinaryAndEmptyValuesRoundTrip) {
  Bytes every_byte;
  for (int i = 0; i < 256; ++i) every_byte.push_back(static_cast<uint8_t>(255 - i));
  stores_.a->set("binary", every_byte);
  EXPECT_EQ(stores_.b->get("binary", milliseconds(1000)), every_byte);
  stores_.a->set("empty", Bytes{});
  EXPECT_TRUE(stores_.b->check({"empty"}));
  EXPECT_EQ(stores_.b->get("empty", milliseconds(1000)), Bytes{});
  const std::string odd_key = "a key/with spaces\n and \xff bytes";
  stores_.a->set(odd_key, std::string("v"));
  EXPECT_EQ(stores_.b->get_string(odd_key, milliseconds(1000)), "v");
}

TEST_P(StoreConformance, WaitAndCheckCoverManyKeys) {
  std::vector<std::string> keys;
  for (int i = 0; i < 150; ++i) keys.push_back("many/" + std::to_string(i));
  for (size_t i = 0; i + 1 < keys.size(); ++i) stores_.a->set(keys[i], std::string("x"));
  EXPECT_FALSE(stores_.b->check(keys));  // only the last one is missing
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    stores_.a->set(keys.back(), std::string("x"));
  });
  stores_.b->wait(keys, milliseconds(5000));
  setter.join();
  EXPECT_TRUE(stores_.b->check(keys));
}

INSTANTIATE_TEST_SUITE_P(Store, StoreConformance,
                         ::testing::Values("memory", "prefix", "tcp", "etcd"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(Store, PrefixIsolatesKeys) {
  auto base = make_memory_store();
  auto a = make_prefix_store("a", base);
  auto b = make_prefix_store("b", base);
  a->set("x", std::string("1"));
  EXPECT_FALSE(b->check({"x"}));
  EXPECT_TRUE(base->check({"a/x"}));
  exercise(*a, *a);
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

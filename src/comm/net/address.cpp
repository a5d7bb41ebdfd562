#include "comm/net/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>

#include <set>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/store.h"

namespace dtrain::net {
namespace {

std::string numeric(const sockaddr* a) {
  char buf[NI_MAXHOST] = {0};
  const socklen_t len = a->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (getnameinfo(a, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0) return {};
  std::string s = buf;
  // Link-local IPv6 comes back as "fe80::1%eth0"; Gloo's resolver accepts that form.
  return s;
}

// Calls f(name, flags, address) for every interface address of family AF_INET or AF_INET6.
template <typename F>
void for_each_address(F&& f) {
  ifaddrs* head = nullptr;
  if (getifaddrs(&head) != 0) return;
  for (ifaddrs* i = head; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    f(std::string(i->ifa_name), i->ifa_flags, i->ifa_addr);
  }
  freeifaddrs(head);
}

}  // namespace

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::string interface_address(const std::string& name) {
  std::string v4, v6;
  std::set<std::string> names;
  for_each_address([&](const std::string& n, unsigned flags, const sockaddr* a) {
    if (flags & IFF_UP) names.insert(n);
    if (n != name || !(flags & IFF_UP)) return;
    if (a->sa_family == AF_INET && v4.empty()) v4 = numeric(a);
    if (a->sa_family == AF_INET6 && v6.empty()) v6 = numeric(a);
  });
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument(ErrorContext{-1, -1, "listen address", -1},
                        fmt::format("network interface '{}' does not exist, is down or has no "
                                    "address (interfaces up: {}); check GLOO_SOCKET_IFNAME / "
                                    "CommunicatorOptions::interface",
                                    name, known.empty() ? "none" : known));
}

std::string first_external_address() {
  std::string v4, v6;
  for_each_address([&](const std::string&, unsigned flags, const sockaddr* a) {
    if (!(flags & IFF_UP) || (flags & IFF_LOOPBACK)) return;
    if (a->sa_family == AF_INET && v4.empty()) v4 = numeric(a);
    if (a->sa_family == AF_INET6 && v6.empty()) {
      // A link-local IPv6 address needs a scope to be reachable; prefer a global one.
      const auto* a6 = reinterpret_cast<const sockaddr_in6*>(a);
      if (!IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) v6 = numeric(a);
    }
  });
  return !v4.empty() ? v4 : v6;
}

std::string resolve_numeric(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* head = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &head) != 0 || head == nullptr) return {};
  std::string a = numeric(head->ai_addr);
  freeaddrinfo(head);
  return a;
}

std::string local_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return {};
  if (a.ss_family != AF_INET && a.ss_family != AF_INET6) return {};
  return numeric(reinterpret_cast<const sockaddr*>(&a));
}

std::string choose_listen_address(const std::string& interface, const std::string& hostname,
                                  const Store& store) {
  if (!interface.empty()) return interface_address(interface);
  if (!hostname.empty()) return hostname;
  std::string a = store.network_address();
  return a.empty() ? "127.0.0.1" : a;
}

}  // namespace dtrain::net

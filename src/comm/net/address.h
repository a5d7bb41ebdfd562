// Which local address a rank listens on, so that its peers (on this host or others) can
// reach it. One place for the rule, used by every communicator:
//
//   1. CommunicatorOptions::interface (or GLOO_SOCKET_IFNAME through LaunchInfo): that
//      interface's address;
//   2. CommunicatorOptions::hostname: as given;
//   3. the store's network address: the local end of this process's connection to the
//      store server, i.e. the address of the interface that routes to MASTER_ADDR
//      (loopback only when the master is loopback);
//   4. 127.0.0.1 (in-process stores: every rank is a thread of this process).
#pragma once

#include <string>

// Part of dtrain_core (src/CMakeLists.txt), which compiles without LibTorch: the rule takes
// the two options' values, not CommunicatorOptions, whose header is LibTorch's.
namespace dtrain {
class Store;
}  // namespace dtrain

namespace dtrain::net {

// True for "localhost", 127.0.0.0/8 and ::1 (as written, without resolving).
bool is_loopback_host(const std::string& host);

// Numeric address of network interface `name` (IPv4 preferred). Throws
// dtrain::InvalidArgument naming the interfaces that exist when it has none.
std::string interface_address(const std::string& name);

// Address of the first interface that is up, not loopback, and has an IPv4 (else IPv6)
// address; empty when there is none.
std::string first_external_address();

// First address `host` resolves to, numeric; empty when it does not resolve.
std::string resolve_numeric(const std::string& host);

// Local address (numeric) of connected socket `fd`; empty when it cannot be read.
std::string local_address(int fd);

// The listening address by the rule above, for CommunicatorOptions::interface and
// CommunicatorOptions::hostname (either may be empty).
std::string choose_listen_address(const std::string& interface, const std::string& hostname,
                                  const Store& store);

}  // namespace dtrain::net

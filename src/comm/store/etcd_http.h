// The wire side of the etcd store: a small HTTP/1.1 client (POST of a JSON body over a plain
// socket, one kept-alive connection) for etcd v3's JSON gateway, and the codecs it needs.
// No HTTP library: etcd's gateway needs only Content-Length requests and answers with
// Content-Length or chunked bodies.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "comm/store/socket.h"

namespace dtrain::detail {

struct EtcdEndpoint {
  std::string host;
  uint16_t port = 0;
  std::string text() const;  // "host:port"
};

// Parses "host:port" entries separated by commas, each optionally prefixed by "http://" and
// followed by a "/"; IPv6 as "[::1]:2379". Throws std::invalid_argument naming the bad entry
// ("https://" is refused: the client speaks plain HTTP only).
std::vector<EtcdEndpoint> parse_etcd_endpoints(const std::string& list);

// Standard base64 with padding, as etcd's gateway encodes bytes fields.
std::string base64_encode(std::string_view bytes);
// Throws std::invalid_argument on a character outside the alphabet or a bad length.
std::string base64_decode(std::string_view text);

// A failed exchange. `sent`: the whole request reached the socket before the failure, so the
// server may have applied it; otherwise it certainly did not.
class HttpFailure : public std::runtime_error {
 public:
  HttpFailure(const std::string& what, bool sent) : std::runtime_error(what), sent_(sent) {}
  bool sent() const { return sent_; }

 private:
  bool sent_;
};

struct HttpResponse {
  int status = 0;
  std::string body;
};

// One connection to one of several endpoints, opened on demand and kept alive between
// requests. Not thread-safe: the caller serialises requests.
class HttpClient {
 public:
  explicit HttpClient(std::vector<EtcdEndpoint> endpoints);

  // POSTs `body` (JSON) to `path` and reads the whole response before `deadline`. A broken or
  // refused connection moves to the next endpoint for the next call. Throws HttpFailure.
  HttpResponse post(const std::string& path, const std::string& body, Clock::time_point deadline);

  // The endpoint the last request went to (or will go to).
  const EtcdEndpoint& endpoint() const { return endpoints_[current_]; }
  // Numeric local address of the open connection; empty when none is open.
  std::string local_address() const;

 private:
  void ensure_connected(Clock::time_point deadline);
  void drop_connection();

  std::vector<EtcdEndpoint> endpoints_;
  size_t current_ = 0;
  Socket socket_;
};

}  // namespace dtrain::detail

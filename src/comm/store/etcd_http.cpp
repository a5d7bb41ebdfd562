#include "comm/store/etcd_http.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "comm/net/address.h"

namespace dtrain::detail {
namespace {

constexpr size_t kMaxHeaderBytes = 64 << 10;
// etcd answers a range of one key; its own request limit is 1.5 MiB by default, so a reply
// far beyond that means something other than etcd is talking.
constexpr size_t kMaxBodyBytes = 256u << 20;

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// Reads a response from a socket with a deadline. Every failure is "sent": the request went out.
class Reader {
 public:
  Reader(int fd, Clock::time_point deadline) : fd_(fd), deadline_(deadline) {}

  std::string line() {
    for (;;) {
      const size_t eol = buf_.find("\r\n", pos_);
      if (eol != std::string::npos) {
        std::string l = buf_.substr(pos_, eol - pos_);
        pos_ = eol + 2;
        return l;
      }
      if (buf_.size() - pos_ > kMaxHeaderBytes) fail("a header line longer than 64 KiB");
      fill();
    }
  }

  std::string take(size_t n) {
    while (buf_.size() - pos_ < n) fill();
    std::string out = buf_.substr(pos_, n);
    pos_ += n;
    return out;
  }

  // Everything until the peer closes (a body with neither length nor chunking).
  std::string rest() {
    for (;;) {
      if (buf_.size() - pos_ > kMaxBodyBytes) fail("a body larger than 256 MiB");
      if (!fill(/*eof_ok=*/true)) break;
    }
    std::string out = buf_.substr(pos_);
    pos_ = buf_.size();
    return out;
  }

  [[noreturn]] static void fail(const std::string& why) {
    throw HttpFailure("malformed HTTP response: " + why, true);
  }

 private:
  bool fill(bool eof_ok = false) {
    char tmp[64 << 10];
    for (;;) {
      const ssize_t k = ::recv(fd_, tmp, sizeof(tmp), MSG_DONTWAIT);
      if (k > 0) {
        buf_.append(tmp, static_cast<size_t>(k));
        return true;
      }
      if (k == 0) {
        if (eof_ok) return false;
        throw HttpFailure("connection closed before the whole response arrived", true);
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        throw HttpFailure(std::string("recv: ") + std::strerror(errno), true);
      pollfd p{fd_, POLLIN, 0};
      const int rc = ::poll(&p, 1, remaining_ms(deadline_));
      if (rc == 0) throw HttpFailure("timed out waiting for the response", true);
      if (rc < 0 && errno != EINTR)
        throw HttpFailure(std::string("poll: ") + std::strerror(errno), true);
    }
  }

  int fd_;
  Clock::time_point deadline_;
  std::string buf_;
  size_t pos_ = 0;
};

size_t parse_size(const std::string& text, int base, const char* what) {
  const std::string t = trim(text);
  if (t.empty() || t.size() > 15) Reader::fail(fmt::format("bad {} '{}'", what, text));
  size_t v = 0;
  for (char c : t) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (base == 16 && c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else if (base == 16 && c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else {
      Reader::fail(fmt::format("bad {} '{}'", what, text));
    }
    v = v * static_cast<size_t>(base) + static_cast<size_t>(d);
  }
  if (v > kMaxBodyBytes) Reader::fail(fmt::format("{} {} is larger than 256 MiB", what, v));
  return v;
}

}  // namespace

std::string EtcdEndpoint::text() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port)
                                             : fmt::format("{}:{}", host, port);
}

std::vector<EtcdEndpoint> parse_etcd_endpoints(const std::string& list) {
  std::vector<EtcdEndpoint> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string entry = trim(list.substr(start, comma - start));
    const std::string original = entry;
    auto bad = [&](const std::string& why) {
      throw std::invalid_argument(fmt::format("etcd endpoint '{}': {}", original, why));
    };
    if (entry.rfind("https://", 0) == 0) bad("https is not supported (plain http only)");
    if (entry.rfind("http://", 0) == 0) entry = entry.substr(7);
    if (!entry.empty() && entry.back() == '/') entry.pop_back();
    if (entry.empty()) bad("empty; expected host:port");
    EtcdEndpoint e;
    size_t colon;
    if (entry[0] == '[') {
      const size_t close = entry.find(']');
      if (close == std::string::npos) bad("missing ']'");
      e.host = entry.substr(1, close - 1);
      colon = close + 1;
      if (colon >= entry.size() || entry[colon] != ':') bad("expected host:port");
    } else {
      colon = entry.rfind(':');
      if (colon == std::string::npos || entry.find(':') != colon) bad("expected host:port");
      e.host = entry.substr(0, colon);
    }
    const std::string port = entry.substr(colon + 1);
    if (e.host.empty()) bad("no host");
    if (port.empty() || port.size() > 5 ||
        port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) < 1 ||
        std::stoi(port) > 65535)
      bad("the port must be a number in [1, 65535]");
    e.port = static_cast<uint16_t>(std::stoi(port));
    out.push_back(e);
    start = comma + 1;
  }
  return out;
}

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint32_t(uint8_t(bytes[i])) << 16) |
                       (uint32_t(uint8_t(bytes[i + 1])) << 8) | uint8_t(bytes[i + 2]);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  if (i < bytes.size()) {
    uint32_t v = uint32_t(uint8_t(bytes[i])) << 16;
    if (i + 1 < bytes.size()) v |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string base64_decode(std::string_view text) {
  if (text.size() % 4 != 0)
    throw std::invalid_argument(
        fmt::format("base64: length {} is not a multiple of 4", text.size()));
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (size_t j = 0; j < 4; ++j) {
      const char c = text[i + j];
      uint32_t d = 0;
      if (c == '=' && i + 4 == text.size() && j >= 2 && (j == 3 || text[i + 3] == '=')) {
        ++pad;
      } else {
        const char* p = c == '\0' ? nullptr : std::strchr(kAlphabet, c);
        if (p == nullptr || pad > 0)
          throw std::invalid_argument(fmt::format("base64: bad character at offset {}", i + j));
        d = static_cast<uint32_t>(p - kAlphabet);
      }
      v = (v << 6) | d;
    }
    out += static_cast<char>((v >> 16) & 255);
    if (pad < 2) out += static_cast<char>((v >> 8) & 255);
    if (pad < 1) out += static_cast<char>(v & 255);
  }
  return out;
}

HttpClient::HttpClient(std::vector<EtcdEndpoint> endpoints) : endpoints_(std::move(endpoints)) {
  if (endpoints_.empty()) throw std::invalid_argument("no etcd endpoint");
}

void HttpClient::drop_connection() {
  socket_ = Socket();
  current_ = (current_ + 1) % endpoints_.size();
}

void HttpClient::ensure_connected(Clock::time_point deadline) {
  if (socket_.fd() >= 0) {
    // A kept-alive connection the server closed meanwhile reads as EOF (or stray bytes):
    // reconnect now rather than find out after sending.
    pollfd p{socket_.fd(), POLLIN, 0};
    char c;
    if (::poll(&p, 1, 0) == 0) return;
    if (::recv(socket_.fd(), &c, 1, MSG_PEEK | MSG_DONTWAIT) < 0 &&
        (errno == EAGAIN || errno == EWOULDBLOCK))
      return;
    socket_ = Socket();
  }
  const EtcdEndpoint& e = endpoints_[current_];
  // With several endpoints, one that does not answer must not use up the whole deadline.
  const Clock::time_point until =
      endpoints_.size() > 1 ? std::min(deadline, Clock::now() + std::chrono::seconds(2)) : deadline;
  try {
    socket_ = connect_tcp(e.host, e.port, until);
  } catch (const std::exception& ex) {
    current_ = (current_ + 1) % endpoints_.size();
    throw HttpFailure(ex.what(), false);
  }
}

std::string HttpClient::local_address() const {
  return socket_.fd() < 0 ? std::string() : net::local_address(socket_.fd());
}

HttpResponse HttpClient::post(const std::string& path, const std::string& body,
                              Clock::time_point deadline) {
  ensure_connected(deadline);
  const EtcdEndpoint& e = endpoints_[current_];
  const std::string request = fmt::format(
      "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: "
      "application/json\r\nContent-Length: {}\r\n\r\n",
      path, e.text(), body.size());
  try {
    send_all(socket_.fd(), request.data(), request.size(), deadline);
    send_all(socket_.fd(), body.data(), body.size(), deadline);
  } catch (const std::exception& ex) {
    // Not all of the request left: the server cannot have acted on it.
    drop_connection();
    throw HttpFailure(std::string("sending the request: ") + ex.what(), false);
  }
  try {
    Reader r(socket_.fd(), deadline);
    HttpResponse resp;
    bool chunked = false, close = false;
    long long length = -1;
    do {  // 1xx interim responses precede the real one
      const std::string status = r.line();
      if (status.rfind("HTTP/1.", 0) != 0 || status.size() < 12)
        Reader::fail(fmt::format("status line '{}'", status.substr(0, 80)));
      resp.status = static_cast<int>(parse_size(status.substr(9, 3), 10, "status"));
      for (std::string h = r.line(); !h.empty(); h = r.line()) {
        const size_t colon = h.find(':');
        if (colon == std::string::npos) Reader::fail(fmt::format("header '{}'", h.substr(0, 80)));
        const std::string name = lower(trim(h.substr(0, colon)));
        const std::string value = lower(trim(h.substr(colon + 1)));
        if (name == "content-length")
          length = static_cast<long long>(parse_size(value, 10, "Content-Length"));
        if (name == "transfer-encoding" && value.find("chunked") != std::string::npos)
          chunked = true;
        if (name == "connection" && value.find("close") != std::string::npos) close = true;
      }
    } while (resp.status >= 100 && resp.status < 200);
    if (chunked) {
      for (;;) {
        const std::string size_line = r.line();
        const size_t n = parse_size(size_line.substr(0, size_line.find(';')), 16, "chunk size");
        if (n == 0) {
          while (!r.line().empty()) {
          }
          break;
        }
        if (resp.body.size() + n > kMaxBodyBytes) Reader::fail("a body larger than 256 MiB");
        resp.body += r.take(n);
        if (!r.line().empty()) Reader::fail("chunk not followed by CRLF");
      }
    } else if (length >= 0) {
      resp.body = r.take(static_cast<size_t>(length));
    } else {
      resp.body = r.rest();
      close = true;
    }
    if (close) socket_ = Socket();
    return resp;
  } catch (const HttpFailure&) {
    drop_connection();
    throw;
  }
}

}  // namespace dtrain::detail

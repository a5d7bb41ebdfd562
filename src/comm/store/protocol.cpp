#include "comm/store/protocol.h"

#include <charconv>
#include <cstring>

#include <fmt/format.h>

namespace dtrain::store_protocol {
namespace {

void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void put_i64(std::string& s, int64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }

std::string frame(Command cmd, std::string_view payload) {
  std::string f;
  f.reserve(5 + payload.size());
  put_u32(f, static_cast<uint32_t>(payload.size() + 1));
  f.push_back(static_cast<char>(cmd));
  f.append(payload);
  return f;
}

// A key as an error message shows it: keys may be binary or long.
std::string quote(std::string_view s) {
  constexpr size_t kShown = 64;
  std::string q = "'";
  for (size_t i = 0; i < s.size() && i < kShown; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      q.push_back(static_cast<char>(c));
    } else {
      q += fmt::format("\\x{:02x}", c);
    }
  }
  q += s.size() > kShown ? "'..." : "'";
  return q;
}

void bad_request(std::string& out, const std::string& message) {
  put_reply(out, kBadRequest, message);
}

// Reads a u32-length-prefixed key from the front of `p`; false when it does not fit.
bool take_key(std::string_view& p, std::string_view* key) {
  if (p.size() < 4) return false;
  const uint32_t len = read_u32(p.data());
  if (p.size() - 4 < len) return false;
  *key = p.substr(4, len);
  p.remove_prefix(4 + static_cast<size_t>(len));
  return true;
}

}  // namespace

bool constant_time_equal(std::string_view a, std::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

bool parse_int64(std::string_view text, int64_t* value) {
  if (text.empty()) {
    *value = 0;
    return true;
  }
  const char* end = text.data() + text.size();
  const auto r = std::from_chars(text.data(), end, *value);
  return r.ec == std::errc() && r.ptr == end;
}

std::string check_key(const char* op, std::string_view key, const Limits& limits) {
  if (key.size() <= limits.max_key_bytes) return {};
  return fmt::format("{}: key of {} bytes exceeds max_key_bytes={}", op, key.size(),
                     limits.max_key_bytes);
}

std::string check_value(const char* op, size_t value_bytes, const Limits& limits) {
  if (value_bytes <= limits.max_value_bytes) return {};
  return fmt::format("{}: value of {} bytes exceeds max_value_bytes={}", op, value_bytes,
                     limits.max_value_bytes);
}

std::string encode_hello(std::string_view token) {
  std::string p;
  put_u32(p, kMagic);
  p.push_back(static_cast<char>(kVersion));
  p.append(token);
  return frame(kHello, p);
}

std::string encode_set(std::string_view key, std::string_view value) {
  std::string p;
  p.reserve(4 + key.size() + value.size());
  put_u32(p, static_cast<uint32_t>(key.size()));
  p.append(key);
  p.append(value);
  return frame(kSet, p);
}

std::string encode_get(std::string_view key) { return frame(kGet, key); }

std::string encode_add(std::string_view key, int64_t delta) {
  std::string p;
  put_i64(p, delta);
  p.append(key);
  return frame(kAdd, p);
}

std::string encode_check(const std::vector<std::string>& keys) {
  std::string p;
  put_u32(p, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) {
    put_u32(p, static_cast<uint32_t>(k.size()));
    p.append(k);
  }
  return frame(kCheck, p);
}

void put_reply(std::string& out, Status status, std::string_view payload) {
  put_u32(out, static_cast<uint32_t>(payload.size() + 1));
  out.push_back(static_cast<char>(status));
  out.append(payload);
}

uint32_t read_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

int64_t read_i64(const char* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

Verdict Server::consume(Session& s, const char* data, size_t n, std::string& out) {
  s.in.append(data, n);
  size_t pos = 0;
  Verdict verdict = Verdict::kKeep;
  while (s.in.size() - pos >= 4) {
    const uint32_t len = read_u32(s.in.data() + pos);
    const uint32_t bound = s.greeted ? limits_.max_frame_bytes() : kMaxHelloFrameBytes;
    if (len > bound) {
      // The rest of the stream cannot be framed: refuse and end the connection.
      put_reply(out, kRefused,
                s.greeted ? fmt::format("frame of {} bytes exceeds the bound of {} bytes "
                                        "(max_key_bytes + max_value_bytes + 5)",
                                        len, bound)
                          : std::string("not a dtrain store client (bad handshake)"));
      verdict = Verdict::kClose;
      break;
    }
    if (s.in.size() - pos - 4 < len) break;
    verdict = handle(s, std::string_view(s.in).substr(pos + 4, len), out);
    pos += 4 + static_cast<size_t>(len);
    if (verdict == Verdict::kClose) break;
    // A client that sends requests without reading the replies is dropped, not buffered for.
    if (out.size() > limits_.max_unread_reply_bytes) {
      verdict = Verdict::kClose;
      break;
    }
  }
  if (verdict == Verdict::kClose) {
    s.in.clear();
  } else {
    s.in.erase(0, pos);
  }
  return verdict;
}

Verdict Server::handle(Session& s, std::string_view f, std::string& out) {
  if (!s.greeted && (f.empty() || f[0] != kHello)) {
    put_reply(out, kRefused, "not a dtrain store client (no handshake)");
    return Verdict::kClose;
  }
  if (f.empty()) {
    bad_request(out, "empty frame (no command)");
    return Verdict::kKeep;
  }
  const uint8_t cmd = static_cast<uint8_t>(f[0]);
  const std::string_view payload = f.substr(1);
  if (cmd == kHello) return hello(s, payload, out);
  switch (cmd) {
    case kSet:
      set(payload, out);
      break;
    case kGet:
      get(payload, out);
      break;
    case kAdd:
      add(payload, out);
      break;
    case kCheck:
      check(payload, out);
      break;
    default:
      bad_request(out, fmt::format("unknown command {}", cmd));
  }
  return Verdict::kKeep;
}

Verdict Server::hello(Session& s, std::string_view p, std::string& out) {
  if (s.greeted) {
    bad_request(out, "handshake repeated");
    return Verdict::kKeep;
  }
  if (p.size() < 5 || read_u32(p.data()) != kMagic) {
    put_reply(out, kRefused, "not a dtrain store client (bad handshake)");
    return Verdict::kClose;
  }
  if (static_cast<uint8_t>(p[4]) != kVersion) {
    put_reply(out, kRefused,
              fmt::format("store protocol version {} (server speaks {}): every process of a "
                          "job must run the same dtrain",
                          static_cast<uint8_t>(p[4]), kVersion));
    return Verdict::kClose;
  }
  if (!constant_time_equal(p.substr(5), token_)) {
    put_reply(out, kRefused, "wrong or missing DTRAIN_STORE_TOKEN");
    return Verdict::kClose;
  }
  s.greeted = true;
  put_reply(out, kOk, {});
  return Verdict::kKeep;
}

void Server::set(std::string_view p, std::string& out) {
  std::string_view key;
  if (!take_key(p, &key)) return bad_request(out, "set: malformed request");
  std::string e = check_key("set", key, limits_);
  if (e.empty()) e = check_value("set", p.size(), limits_);
  if (!e.empty()) return bad_request(out, e);
  auto it = data_.find(key);
  if (it == data_.end()) {
    data_.emplace(std::string(key), std::string(p));
  } else {
    it->second.assign(p);
  }
  put_reply(out, kOk, {});
}

void Server::get(std::string_view key, std::string& out) {
  if (std::string e = check_key("get", key, limits_); !e.empty()) return bad_request(out, e);
  auto it = data_.find(key);
  std::string r(1, it == data_.end() ? '\0' : '\1');
  if (it != data_.end()) r += it->second;
  put_reply(out, kOk, r);
}

void Server::add(std::string_view p, std::string& out) {
  if (p.size() < 8) return bad_request(out, "add: malformed request");
  const int64_t delta = read_i64(p.data());
  const std::string_view key = p.substr(8);
  if (std::string e = check_key("add", key, limits_); !e.empty()) return bad_request(out, e);
  auto it = data_.find(key);
  int64_t x = 0;
  if (it != data_.end() && !parse_int64(it->second, &x)) {
    return bad_request(out, fmt::format("add: key {} holds {} bytes that are not a decimal "
                                        "integer (set by store.set?)",
                                        quote(key), it->second.size()));
  }
  int64_t sum = 0;
  if (__builtin_add_overflow(x, delta, &sum)) {
    return bad_request(
        out, fmt::format("add: key {} would overflow int64 ({} + {})", quote(key), x, delta));
  }
  if (it == data_.end()) it = data_.emplace(std::string(key), std::string()).first;
  it->second = std::to_string(sum);
  std::string r;
  put_i64(r, sum);
  put_reply(out, kOk, r);
}

void Server::check(std::string_view p, std::string& out) {
  if (p.size() < 4) return bad_request(out, "check: malformed request");
  const uint32_t n = read_u32(p.data());
  p.remove_prefix(4);
  bool all = true;
  for (uint32_t i = 0; i < n; ++i) {
    std::string_view key;
    if (!take_key(p, &key)) return bad_request(out, "check: malformed request");
    if (std::string e = check_key("check", key, limits_); !e.empty()) return bad_request(out, e);
    all = all && data_.find(key) != data_.end();
  }
  if (!p.empty()) return bad_request(out, "check: malformed request (trailing bytes)");
  put_reply(out, kOk, std::string(1, all ? '\1' : '\0'));
}

}  // namespace dtrain::store_protocol

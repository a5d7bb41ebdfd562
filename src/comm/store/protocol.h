// The TCP store's wire protocol, and the server's side of it as a pure function of the bytes
// a client sends (no sockets, no threads), so that it can be unit-tested and fuzzed.
//
// Frames, little-endian (the peers of one job share an architecture):
//   request = u32 length, u8 command, payload      (length counts command + payload)
//   reply   = u32 length, u8 status, payload       (length counts status + payload)
// Requests and their ok replies:
//   hello  u32 magic, u8 version, token         -> ok            (must be the first request)
//   set    u32 key length, key, value           -> ok
//   get    key                                  -> ok, u8 found, value
//   add    i64 delta, key                       -> ok, i64 result
//   check  u32 count, count x (u32 len, key)    -> ok, u8 all set
// A malformed request, or one over a bound, gets kBadRequest and a message; the connection
// stays usable because frame boundaries are intact. A frame header over the bound, a missing
// or wrong hello, or more unread replies than the bound end the connection (after a
// kRefused reply where the client may still read it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::store_protocol {

enum Command : uint8_t { kHello = 0, kSet = 1, kGet = 2, kAdd = 3, kCheck = 4 };
enum Status : uint8_t { kOk = 0, kBadRequest = 1, kRefused = 2 };

constexpr uint32_t kMagic = 0x74737464;  // "dtst"
constexpr uint8_t kVersion = 1;
constexpr size_t kMaxTokenBytes = 1024;
// Before the handshake a client may send no more than a hello: an outsider costs the server
// a few bytes, not a frame buffer.
constexpr uint32_t kMaxHelloFrameBytes = 1 + 4 + 1 + kMaxTokenBytes;

struct Limits {
  uint32_t max_key_bytes = 4096;
  uint32_t max_value_bytes = 4u << 20;
  // Replies a client has not read yet; over this the connection is closed.
  size_t max_unread_reply_bytes = 8u << 20;

  // The longest request frame: a set with the longest key and value.
  uint32_t max_frame_bytes() const { return 1 + 4 + max_key_bytes + max_value_bytes; }
};

// Equality whose running time depends on the lengths only, not on where the bytes differ.
bool constant_time_equal(std::string_view a, std::string_view b);

// Strict decimal int64 ("" is 0): false for anything else, including overflow.
bool parse_int64(std::string_view text, int64_t* value);

// Bounds checks shared by client and server; empty when fine, else the message.
std::string check_key(const char* op, std::string_view key, const Limits& limits);
std::string check_value(const char* op, size_t value_bytes, const Limits& limits);

// Request frames, as a client sends them.
std::string encode_hello(std::string_view token);
std::string encode_set(std::string_view key, std::string_view value);
std::string encode_get(std::string_view key);
std::string encode_add(std::string_view key, int64_t delta);
std::string encode_check(const std::vector<std::string>& keys);

// Appends a reply frame.
void put_reply(std::string& out, Status status, std::string_view payload);

// A reply as the client reads it: status, then payload.
uint32_t read_u32(const char* p);
int64_t read_i64(const char* p);

// One client's state on the server: whether it said hello, and bytes of an incomplete frame.
struct Session {
  bool greeted = false;
  std::string in;
};

enum class Verdict { kKeep, kClose };  // kClose: send what is in `out`, then close

// The server's key-value table and request handling.
class Server {
 public:
  Server(Limits limits, std::string token) : limits_(limits), token_(std::move(token)) {}

  // Handles the `n` bytes that arrived from one client: appends reply frames to `out` and
  // keeps an incomplete frame in `session.in` (less than 4 + max_frame_bytes(), or before the
  // handshake 4 + kMaxHelloFrameBytes).
  // Never throws for any input (std::bad_alloc aside).
  Verdict consume(Session& session, const char* data, size_t n, std::string& out);

  size_t size() const { return data_.size(); }
  const Limits& limits() const { return limits_; }

 private:
  Verdict handle(Session& session, std::string_view frame, std::string& out);
  Verdict hello(Session& session, std::string_view payload, std::string& out);
  void set(std::string_view payload, std::string& out);
  void get(std::string_view payload, std::string& out);
  void add(std::string_view payload, std::string& out);
  void check(std::string_view payload, std::string& out);

  Limits limits_;
  std::string token_;
  std::map<std::string, std::string, std::less<>> data_;
};

}  // namespace dtrain::store_protocol

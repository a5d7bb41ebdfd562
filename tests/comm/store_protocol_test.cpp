// The store's message handling without sockets (src/comm/store/protocol.h), and the accept
// back-off rule of its server.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "comm/store/protocol.h"
#include "comm/store/store_server.h"

namespace dtrain::store_protocol {
namespace {

struct Reply {
  uint8_t status;
  std::string payload;
};

// Splits `out` into reply frames; fails the test on a malformed one.
std::vector<Reply> replies(const std::string& out) {
  std::vector<Reply> r;
  size_t pos = 0;
  while (pos < out.size()) {
    EXPECT_GE(out.size() - pos, 5u);
    if (out.size() - pos < 5) break;
    const uint32_t len = read_u32(out.data() + pos);
    EXPECT_GE(len, 1u);
    EXPECT_LE(pos + 4 + len, out.size());
    if (len < 1 || pos + 4 + len > out.size()) break;
    r.push_back({static_cast<uint8_t>(out[pos + 4]), out.substr(pos + 5, len - 1)});
    pos += 4 + len;
  }
  return r;
}

Limits small() {
  Limits l;
  l.max_key_bytes = 16;
  l.max_value_bytes = 64;
  l.max_unread_reply_bytes = 256;
  return l;
}

// A greeted session on `server`, and helpers to send frames through it.
struct Client {
  Server& server;
  Session session;
  std::string out;

  explicit Client(Server& s, const std::string& token = "") : server(s) {
    EXPECT_EQ(send(encode_hello(token)), Verdict::kKeep);
    out.clear();
  }
  Verdict send(const std::string& frames) {
    return server.consume(session, frames.data(), frames.size(), out);
  }
  Reply one(const std::string& frame) {
    out.clear();
    EXPECT_EQ(send(frame), Verdict::kKeep);
    auto r = replies(out);
    EXPECT_EQ(r.size(), 1u);
    return r.empty() ? Reply{255, ""} : r[0];
  }
};

TEST(StoreProtocol, AddOnANonNumberIsAnErrorReplyAndTheConnectionStaysUsable) {
  Server server(small(), "");
  Client c(server);
  EXPECT_EQ(c.one(encode_set("k", "abc")).status, kOk);
  const Reply r = c.one(encode_add("k", 1));
  EXPECT_EQ(r.status, kBadRequest);
  EXPECT_EQ(r.payload,
            "add: key 'k' holds 3 bytes that are not a decimal integer (set by store.set?)");
  EXPECT_EQ(c.one(encode_set("k", "12x")).status, kOk);  // std::stoll would accept "12x"
  EXPECT_EQ(c.one(encode_add("k", 1)).status, kBadRequest);
  const Reply n = c.one(encode_add("n", 5));
  ASSERT_EQ(n.status, kOk);
  EXPECT_EQ(read_i64(n.payload.data()), 5);
}

TEST(StoreProtocol, AddThatWouldOverflowIsAnError) {
  Server server(small(), "");
  Client c(server);
  EXPECT_EQ(c.one(encode_add("n", INT64_MAX)).status, kOk);
  const Reply r = c.one(encode_add("n", 1));
  EXPECT_EQ(r.status, kBadRequest);
  EXPECT_EQ(r.payload, "add: key 'n' would overflow int64 (9223372036854775807 + 1)");
}

TEST(StoreProtocol, KeyAndValueBoundsAreErrorReplies) {
  Server server(small(), "");
  Client c(server);
  const std::string long_key(17, 'k');
  Reply r = c.one(encode_set(long_key, "v"));
  EXPECT_EQ(r.status, kBadRequest);
  EXPECT_EQ(r.payload, "set: key of 17 bytes exceeds max_key_bytes=16");
  r = c.one(encode_set("k", std::string(65, 'v')));
  EXPECT_EQ(r.payload, "set: value of 65 bytes exceeds max_value_bytes=64");
  EXPECT_EQ(c.one(encode_get(long_key)).payload, "get: key of 17 bytes exceeds max_key_bytes=16");
  EXPECT_EQ(c.one(encode_add(long_key, 1)).payload,
            "add: key of 17 bytes exceeds max_key_bytes=16");
  EXPECT_EQ(c.one(encode_check({"a", long_key})).payload,
            "check: key of 17 bytes exceeds max_key_bytes=16");
  EXPECT_EQ(c.one(encode_set("k", std::string(64, 'v'))).status, kOk);  // at the bound
  EXPECT_EQ(server.size(), 1u);
}

TEST(StoreProtocol, FrameOverTheBoundIsRefusedAndCloses) {
  Server server(small(), "");
  Client c(server);
  std::string header(4, '\0');
  const uint32_t len = small().max_frame_bytes() + 1;
  std::memcpy(header.data(), &len, 4);
  c.out.clear();
  EXPECT_EQ(c.send(header), Verdict::kClose);
  const auto r = replies(c.out);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].status, kRefused);
  EXPECT_EQ(
      r[0].payload,
      "frame of 86 bytes exceeds the bound of 85 bytes (max_key_bytes + max_value_bytes + 5)");
  EXPECT_TRUE(c.session.in.empty());  // nothing of it is buffered
}

TEST(StoreProtocol, MalformedRequestsAreErrorReplies) {
  Server server(small(), "");
  Client c(server);
  EXPECT_EQ(c.one(std::string("\x01\0\0\0\x09", 5)).payload, "unknown command 9");
  EXPECT_EQ(c.one(std::string("\0\0\0\0", 4)).payload, "empty frame (no command)");
  // set whose key length runs past the frame
  EXPECT_EQ(c.one(std::string("\x06\0\0\0\x01\x63\0\0\0k", 10)).payload, "set: malformed request");
  EXPECT_EQ(c.one(std::string("\x04\0\0\0\x03k\0\0", 8)).payload, "add: malformed request");
  EXPECT_EQ(c.one(std::string("\x09\0\0\0\x04\xff\xff\xff\xff\0\0\0\0", 13)).payload,
            "check: malformed request");
  EXPECT_EQ(c.one(encode_hello("")).payload, "handshake repeated");
  EXPECT_EQ(c.one(encode_get("absent")).status, kOk);
}

TEST(StoreProtocol, HandshakeComesFirstAndCarriesTheToken) {
  Server server(small(), "s3cret");
  const auto refused = [&](const std::string& first) {
    Session s;
    std::string out;
    EXPECT_EQ(server.consume(s, first.data(), first.size(), out), Verdict::kClose);
    auto r = replies(out);
    EXPECT_FALSE(s.greeted);
    return r.size() == 1 && r[0].status == kRefused ? r[0].payload : "(no refusal)";
  };
  EXPECT_EQ(refused(encode_get("k")), "not a dtrain store client (no handshake)");
  EXPECT_EQ(refused(encode_hello("")), "wrong or missing DTRAIN_STORE_TOKEN");
  EXPECT_EQ(refused(encode_hello("s3creT")), "wrong or missing DTRAIN_STORE_TOKEN");
  EXPECT_EQ(refused(encode_hello("s3cret!")), "wrong or missing DTRAIN_STORE_TOKEN");
  EXPECT_EQ(refused("GET / HTTP/1.1\r\n\r\n"), "not a dtrain store client (bad handshake)");
  std::string other_version = encode_hello("s3cret");
  other_version[9] = 7;
  EXPECT_EQ(refused(other_version),
            "store protocol version 7 (server speaks 1): every process of a job must run the "
            "same dtrain");
  Client ok(server, "s3cret");
  EXPECT_TRUE(ok.session.greeted);
  EXPECT_EQ(ok.one(encode_set("k", "v")).status, kOk);
}

TEST(StoreProtocol, ClientThatDoesNotReadIsClosedAtTheBound) {
  Server server(small(), "");
  Client c(server);
  EXPECT_EQ(c.one(encode_set("k", std::string(60, 'v'))).status, kOk);
  c.out.clear();
  std::string many;
  for (int i = 0; i < 100; ++i) many += encode_get("k");
  EXPECT_EQ(c.send(many), Verdict::kClose);
  // Stopped at the first reply over the bound: at most one reply beyond it.
  EXPECT_LE(c.out.size(), small().max_unread_reply_bytes + 4 + 2 + 60);
}

TEST(StoreProtocol, RequestsSplitAnywhereGiveTheSameReplies) {
  Server a(small(), "t"), b(small(), "t");
  std::string stream = encode_hello("t") + encode_set("k", "v") + encode_add("n", 3) +
                       encode_get("k") + encode_check({"k", "n"}) + encode_add("k", 1);
  Session sa, sb;
  std::string oa, ob;
  EXPECT_EQ(a.consume(sa, stream.data(), stream.size(), oa), Verdict::kKeep);
  for (char ch : stream) EXPECT_EQ(b.consume(sb, &ch, 1, ob), Verdict::kKeep);
  EXPECT_EQ(oa, ob);
  EXPECT_EQ(replies(oa).size(), 6u);
  EXPECT_TRUE(sb.in.empty());
}

TEST(StoreProtocol, StrictIntegersAndConstantTimeEquality) {
  int64_t x = -1;
  EXPECT_TRUE(parse_int64("", &x));
  EXPECT_EQ(x, 0);
  EXPECT_TRUE(parse_int64("-42", &x));
  EXPECT_EQ(x, -42);
  for (const char* bad : {"abc", "12x", " 1", "+1", "99999999999999999999", "-"}) {
    EXPECT_FALSE(parse_int64(bad, &x)) << bad;
  }
  EXPECT_TRUE(constant_time_equal("", ""));
  EXPECT_TRUE(constant_time_equal("abc", "abc"));
  EXPECT_FALSE(constant_time_equal("abc", "abd"));
  EXPECT_FALSE(constant_time_equal("abc", "ab"));
  EXPECT_FALSE(constant_time_equal("", "a"));
  EXPECT_FALSE(constant_time_equal(std::string("a\0", 2), "a"));
}

}  // namespace
}  // namespace dtrain::store_protocol

namespace dtrain::detail {
namespace {

TEST(StoreAcceptBackoff, PausesOnResourceErrorsDoublingToOneSecond) {
  AcceptBackoff b;
  const Clock::time_point t0 = Clock::now();
  EXPECT_FALSE(b.paused(t0));
  b.failed(EMFILE, t0);
  EXPECT_TRUE(b.paused(t0));
  EXPECT_EQ(b.delay(), AcceptBackoff::kMin);
  EXPECT_FALSE(b.paused(t0 + AcceptBackoff::kMin));
  b.failed(ENFILE, t0);
  EXPECT_EQ(b.delay(), 2 * AcceptBackoff::kMin);
  for (int err : {ENOBUFS, ENOMEM, EMFILE, EMFILE, EMFILE, EMFILE, EMFILE, EMFILE}) {
    b.failed(err, t0);
  }
  EXPECT_EQ(b.delay(), AcceptBackoff::kMax);
  EXPECT_EQ(b.resume_at(), t0 + AcceptBackoff::kMax);
  b.succeeded();
  b.failed(EMFILE, t0);
  EXPECT_EQ(b.delay(), AcceptBackoff::kMin);
}

TEST(StoreAcceptBackoff, ErrorsOfOneConnectionDoNotPause) {
  AcceptBackoff b;
  const Clock::time_point t0 = Clock::now();
  for (int err : {ECONNABORTED, EINTR, EPROTO, EPERM, EAGAIN}) {
    b.failed(err, t0);
    EXPECT_FALSE(b.paused(t0)) << err;
  }
}

}  // namespace
}  // namespace dtrain::detail

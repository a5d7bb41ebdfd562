// The TCP store server's message handling (src/comm/store/protocol.h) on arbitrary bytes from
// one client: it never throws or crashes, every reply is a well-formed frame with a known
// status, and nothing beyond one incomplete frame stays buffered.
//
// Input: byte 0 picks how the stream is cut into reads (bits 1-7: read size, 0 = all at once)
// and whether a valid handshake goes first (bit 0), so that the commands behind it are
// reached without guessing the magic; the rest is the stream.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "comm/store/protocol.h"

namespace proto = dtrain::store_protocol;

namespace {

[[noreturn]] void fail(const char* why) {
  std::fprintf(stderr, "store_protocol_fuzz: %s\n", why);
  std::abort();
}

// Checks that `out` is a sequence of whole reply frames.
void check_replies(const std::string& out) {
  size_t pos = 0;
  while (pos < out.size()) {
    if (out.size() - pos < 5) fail("truncated reply header");
    const uint32_t len = proto::read_u32(out.data() + pos);
    if (len < 1 || out.size() - pos - 4 < len) fail("reply length does not match its frame");
    const uint8_t status = static_cast<uint8_t>(out[pos + 4]);
    if (status != proto::kOk && status != proto::kBadRequest && status != proto::kRefused) {
      fail("unknown reply status");
    }
    pos += 4 + len;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  proto::Limits limits;
  limits.max_key_bytes = 32;
  limits.max_value_bytes = 256;
  limits.max_unread_reply_bytes = 4096;
  proto::Server server(limits, "tok");
  proto::Session session;
  std::string stream;
  if (data[0] & 1) stream = proto::encode_hello("tok");
  stream.append(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t step = (data[0] >> 1) == 0 ? stream.size() : (data[0] >> 1);

  std::string out;
  for (size_t pos = 0; pos < stream.size(); pos += step) {
    const size_t n = std::min(step, stream.size() - pos);
    const proto::Verdict v = server.consume(session, stream.data() + pos, n, out);
    check_replies(out);
    if (v == proto::Verdict::kClose) {
      if (!session.in.empty()) fail("input kept after close");
      break;
    }
    // At most one incomplete frame, under the bound that applies (a hello's before it).
    const size_t bound = session.greeted ? limits.max_frame_bytes() : proto::kMaxHelloFrameBytes;
    if (session.in.size() >= 4 + bound) fail("buffered a whole frame");
    // The server sends replies as it makes them; the client here reads them all.
    if (out.size() > limits.max_unread_reply_bytes) fail("unread bound not enforced");
    out.clear();
  }
  return 0;
}

// The consistency check of one collective over Gloo: every rank sends its CallHeader to
// every peer over the communicator's pairs, before the collective's data, and compares what
// it received. All ranks see the same headers, so all reach the same verdict.
//
// Cost: one message of sizeof(CallHeader) to and from each peer per collective, i.e. one
// extra one-way latency (all messages are in flight at once). A full mesh, not a ring, so
// the latency does not grow with the world size; the message count per rank does.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/call_header.h"
#include "comm/wire_counter.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}
}  // namespace gloo

namespace dtrain::gloo_backend {

class HeaderExchange {
 public:
  // Counts the headers it sends in `wire` (kControl).
  HeaderExchange(std::shared_ptr<gloo::Context> context, detail::WireTally wire);
  ~HeaderExchange();

  // Exchanges `mine` in Gloo slot `slot` (unique per collective). Throws DesyncError when
  // ranks disagree (the cause names both sides), TimeoutError naming the ranks whose header
  // did not arrive within `timeout`. Executor thread only.
  void run(const detail::CallHeader& mine, uint64_t slot, std::chrono::milliseconds timeout);

 private:
  std::shared_ptr<gloo::Context> context_;
  const detail::WireTally wire_;
  std::vector<detail::CallHeader> headers_;  // [rank], received in place
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
};

}  // namespace dtrain::gloo_backend

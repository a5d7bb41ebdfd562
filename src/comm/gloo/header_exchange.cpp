#include "comm/gloo/header_exchange.h"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>

#include "comm/gloo/bounded_wait.h"
#include "dtrain/errors.h"

namespace dtrain::gloo_backend {

using detail::CallHeader;

HeaderExchange::HeaderExchange(std::shared_ptr<gloo::Context> context, detail::WireTally wire)
    : context_(std::move(context)),
      wire_(std::move(wire)),
      headers_(static_cast<size_t>(context_->size)) {
  buffer_ = context_->createUnboundBuffer(headers_.data(), headers_.size() * sizeof(CallHeader));
}

HeaderExchange::~HeaderExchange() = default;

void HeaderExchange::run(const CallHeader& mine, uint64_t slot, std::chrono::milliseconds timeout) {
  const int n = context_->size;
  const int me = context_->rank;
  if (n == 1) return;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  headers_[static_cast<size_t>(me)] = mine;
  auto offset = [](int r) { return static_cast<size_t>(r) * sizeof(CallHeader); };
  // Receives first: a peer's header can land as soon as it is sent.
  for (int r = 0; r < n; ++r) {
    if (r != me) buffer_->recv(r, slot, offset(r), sizeof(CallHeader));
  }
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    buffer_->send(r, slot, offset(me), sizeof(CallHeader));
    wire_.sent(detail::WireKind::kControl, me, r, sizeof(CallHeader));
  }
  std::vector<bool> arrived(static_cast<size_t>(n), false);
  arrived[static_cast<size_t>(me)] = true;
  for (int k = 0; k < n - 1; ++k) {
    int from = -1;
    const auto bound = left();
    bounded_wait(
        bound, [&] { buffer_->waitRecv(&from, bound); },
        [&](const std::string&) {
          std::vector<int> missing;
          for (int r = 0; r < n; ++r) {
            if (!arrived[static_cast<size_t>(r)]) missing.push_back(r);
          }
          return TimeoutError(fmt::format(
              "rank(s) {} did not issue collective #{} within {} ms (slow, hung, or they issued "
              "fewer collectives); this rank issued {}",
              fmt::join(missing, ", "), mine.sequence, timeout.count(), detail::describe(mine)));
        });
    if (from >= 0 && from < n) arrived[static_cast<size_t>(from)] = true;
  }
  // Peers posted their receives before sending, so these complete at once.
  for (int k = 0; k < n - 1; ++k) {
    const auto bound = left();
    bounded_wait(bound, [&] { buffer_->waitSend(bound); });
  }
  if (auto cause = detail::find_mismatch(headers_)) throw DesyncError(*cause);
}

}  // namespace dtrain::gloo_backend

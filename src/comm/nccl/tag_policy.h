// Point-to-point tags under NCCL. NCCL has no tags: a send matches the peer's next recv in
// issue order. Ignoring a tag would pair messages the caller meant to keep apart, silently, so
// the backend refuses any tag but 0 (docs/nccl.md, "Point to point"). Plain C++ (no CUDA or
// NCCL header), so that the rule is tested on machines without them.
#pragma once

#include <cstdint>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace dtrain::nccl_backend {

// Throws InvalidArgument naming the tag unless it is 0.
inline void check_tag(uint32_t tag, const ErrorContext& ctx) {
  if (tag == 0) return;
  throw InvalidArgument(
      ctx, fmt::format("tag {} (0x{:x}): NCCL has no tags (a send matches the peer's next recv "
                       "in issue order), so the NCCL backend accepts only tag 0; issue the "
                       "sends and recvs of a pair in the same order and pass tag 0, or use the "
                       "Gloo backend",
                       tag, tag));
}

}  // namespace dtrain::nccl_backend

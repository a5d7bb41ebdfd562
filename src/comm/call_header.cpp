#include "comm/call_header.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>

namespace dtrain::detail {
namespace {

constexpr uint8_t kNone = 0xff;

const char* header_dtype_name(uint8_t dtype) {
  return dtype == kNone ? "none" : dtype_name(static_cast<c10::ScalarType>(dtype));
}

bool same_shape(const CallHeader& a, const CallHeader& b) {
  return a.ndim == b.ndim && std::equal(a.dims, a.dims + CallHeader::kMaxDims, b.dims);
}

bool agree(const CallHeader& a, const CallHeader& b, Consistency level) {
  if (a.magic != b.magic || a.sequence != b.sequence || a.op != b.op || a.dtype != b.dtype ||
      a.numel != b.numel || a.reduce != b.reduce || a.root != b.root) {
    return false;
  }
  return level < Consistency::kFingerprint || same_shape(a, b);
}

}  // namespace

const char* dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return "float32";
    case c10::ScalarType::Double:
      return "float64";
    case c10::ScalarType::Half:
      return "float16";
    case c10::ScalarType::BFloat16:
      return "bfloat16";
    case c10::ScalarType::Byte:
      return "uint8";
    case c10::ScalarType::Char:
      return "int8";
    case c10::ScalarType::Short:
      return "int16";
    case c10::ScalarType::Int:
      return "int32";
    case c10::ScalarType::Long:
      return "int64";
    case c10::ScalarType::Bool:
      return "bool";
    default:
      return c10::toString(dtype);
  }
}

const char* to_string(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce:
      return "all_reduce";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kAllGather:
      return "all_gather";
    case CollectiveOp::kReduceScatter:
      return "reduce_scatter";
    case CollectiveOp::kBarrier:
      return "barrier";
  }
  return "?";
}

CallHeader make_header(CollectiveOp op, uint64_t sequence, const at::Tensor& described,
                       std::optional<ReduceOp> reduce, int root, Consistency consistency) {
  CallHeader h;
  h.op = static_cast<uint8_t>(op);
  h.sequence = sequence;
  h.reduce = reduce ? static_cast<uint8_t>(*reduce) : kNone;
  h.root = root;
  h.consistency = static_cast<uint8_t>(consistency);
  if (!described.defined()) {
    h.dtype = kNone;
    return h;
  }
  h.dtype = static_cast<uint8_t>(described.scalar_type());
  h.numel = described.numel();
  h.ndim = static_cast<int32_t>(described.dim());
  for (int64_t d = 0; d < described.dim(); ++d) {
    const int64_t slot = std::min<int64_t>(d, CallHeader::kMaxDims - 1);
    h.dims[slot] = d <= slot ? described.size(d) : h.dims[slot] * described.size(d);
  }
  return h;
}

std::string describe(const CallHeader& h) {
  if (h.magic != CallHeader::kMagic) {
    return fmt::format(
        "a call dtrain cannot read (header magic {:#x}, expected {:#x}: another "
        "dtrain version?)",
        h.magic, CallHeader::kMagic);
  }
  std::string s = fmt::format("{} #{}", to_string(static_cast<CollectiveOp>(h.op)), h.sequence);
  if (h.dtype != kNone) {
    std::vector<std::string> dims;
    const int shown = std::min<int>(h.ndim, CallHeader::kMaxDims);
    for (int d = 0; d < shown; ++d) dims.push_back(std::to_string(h.dims[d]));
    if (h.ndim > CallHeader::kMaxDims) dims.back() += " (folded)";
    s += fmt::format(" {}[{}]", header_dtype_name(h.dtype), fmt::join(dims, ", "));
  }
  if (h.reduce != kNone) s += fmt::format(" {}", to_string(static_cast<ReduceOp>(h.reduce)));
  if (h.root >= 0) s += fmt::format(" root {}", h.root);
  return s;
}

std::optional<std::string> find_mismatch(const std::vector<CallHeader>& headers) {
  Consistency level = Consistency::kCheap;
  for (const CallHeader& h : headers) {
    level = std::max(level, static_cast<Consistency>(std::min<uint8_t>(
                                h.consistency, static_cast<uint8_t>(Consistency::kFingerprint))));
  }
  std::vector<int> differ;
  for (size_t r = 1; r < headers.size(); ++r) {
    if (!agree(headers[0], headers[r], level)) differ.push_back(static_cast<int>(r));
  }
  if (differ.empty()) return std::nullopt;
  std::string msg = fmt::format(
      "ranks issued different collectives: rank 0 issued {}; rank {} "
      "issued {}",
      describe(headers[0]), differ[0], describe(headers[differ[0]]));
  if (differ.size() > 1) {
    msg += fmt::format(" ({} more ranks differ from rank 0: {})", differ.size() - 1,
                       fmt::join(differ.begin() + 1, differ.end(), ", "));
  }
  if (level == Consistency::kFingerprint) msg += " [fingerprint check]";
  return msg;
}

}  // namespace dtrain::detail

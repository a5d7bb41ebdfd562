#include "dtrain/errors.h"

#include <fmt/format.h>

namespace dtrain {
namespace {

std::string format_message(const ErrorContext& c, const std::string& cause) {
  std::string where;
  if (c.rank >= 0) where += fmt::format("rank {}/{}", c.rank, c.world_size);
  if (!c.op.empty()) where += fmt::format("{}{}", where.empty() ? "" : " ", c.op);
  if (c.sequence >= 0) where += fmt::format(" #{}", c.sequence);
  if (where.empty()) return "dtrain: " + cause;
  return fmt::format("dtrain [{}]: {}", where, cause);
}

}  // namespace

Error::Error(const ErrorContext& context, const std::string& cause)
    : std::runtime_error(format_message(context, cause)), context_(context), cause_(cause) {}

}  // namespace dtrain

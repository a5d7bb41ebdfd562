// The description of one collective that ranks compare before moving its data (the
// consistency check, see dtrain/communicator.h). Fixed size and trivially copyable: it is
// sent as raw bytes between ranks of one job, which run the same dtrain.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/communicator.h"

namespace dtrain::detail {

enum class CollectiveOp : uint8_t {
  kAllReduce = 1,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kBarrier,
};

const char* to_string(CollectiveOp op);
// "float32", "int64", ...: the names error messages use.
const char* dtype_name(c10::ScalarType dtype);

struct CallHeader {
  static constexpr uint32_t kMagic = 0x64744331;  // "dtC1": also the format's version
  static constexpr int kMaxDims = 6;              // further dims are folded into the last

  uint32_t magic = kMagic;
  uint8_t op = 0;           // CollectiveOp
  uint8_t dtype = 0;        // c10::ScalarType; 0xff: none (barrier)
  uint8_t reduce = 0xff;    // ReduceOp; 0xff: none
  uint8_t consistency = 0;  // Consistency the sender asks for
  int32_t root = -1;        // broadcast only
  int32_t ndim = 0;         // of the described tensor, unfolded
  uint64_t sequence = 0;
  int64_t numel = 0;
  int64_t dims[kMaxDims] = {};
};
static_assert(sizeof(CallHeader) == 80, "CallHeader is a wire format");

// Describes a collective by the tensor every rank passes with the same shape: the tensor of
// all_reduce and broadcast, the input of all_gather (a shard) and of reduce_scatter (flat).
CallHeader make_header(CollectiveOp op, uint64_t sequence, const at::Tensor& described,
                       std::optional<ReduceOp> reduce, int root, Consistency consistency);

// "all_reduce #17 float32[1024] sum", "broadcast #3 int64[2, 5] root 1", "barrier #4".
std::string describe(const CallHeader& h);

// headers[r] is rank r's header of the same call. If they disagree under the strictest
// consistency any rank asked for: the cause of the DesyncError every rank raises, naming
// rank 0 and the first rank that differs from it (and how many more do); else nullopt.
std::optional<std::string> find_mismatch(const std::vector<CallHeader>& headers);

}  // namespace dtrain::detail

#include "dtrain/communicator.h"

#include <fmt/format.h>

#include "comm/gloo/gloo_communicator.h"
#include "dtrain/config.h"
#include "dtrain/errors.h"
#if DTRAIN_HAS_NCCL
#include "comm/nccl/nccl_communicator.h"
#endif

namespace dtrain {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
  }
  return "?";
}

bool is_backend_available(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return true;
    case Backend::kNccl:
      return DTRAIN_HAS_NCCL != 0;
  }
  return false;
}

CommunicatorPtr make_communicator(std::shared_ptr<Store> store, int rank, int world_size,
                                  const CommunicatorOptions& options) {
  ErrorContext ctx{rank, world_size, "make_communicator", -1};
  if (!store) throw InvalidArgument(ctx, "store is null");
  if (world_size < 1) throw InvalidArgument(ctx, fmt::format("world_size {} < 1", world_size));
  if (rank < 0 || rank >= world_size)
    throw InvalidArgument(ctx, fmt::format("rank {} is not in [0, {})", rank, world_size));
  if (options.timeout.count() <= 0) throw InvalidArgument(ctx, "timeout must be positive");
  switch (options.backend) {
    case Backend::kGloo:
      return std::make_shared<gloo_backend::GlooCommunicator>(std::move(store), rank, world_size,
                                                              options);
    case Backend::kNccl:
#if DTRAIN_HAS_NCCL
      return nccl_backend::make_nccl_communicator(std::move(store), rank, world_size, options);
#else
      throw InvalidArgument(ctx,
                            "this dtrain was built without NCCL (DTRAIN_WITH_NCCL=OFF or "
                            "CUDA/NCCL not found at configure time)");
#endif
  }
  throw InvalidArgument(ctx, "unknown backend");
}

}  // namespace dtrain

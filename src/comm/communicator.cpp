#include "dtrain/communicator.h"

#include <fmt/format.h>

#include "comm/backend_factory.h"
#include "comm/front_end.h"
#include "dtrain/config.h"
#include "dtrain/errors.h"
#include "dtrain/wire_stats.h"

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
    case Backend::kMpi:
      return "mpi";
  }
  return "?";
}

const char* to_string(Consistency consistency) {
  switch (consistency) {
    case Consistency::kCheap:
      return "cheap";
    case Consistency::kFingerprint:
      return "fingerprint";
  }
  return "?";
}

const char* to_string(Transport transport) {
  switch (transport) {
    case Transport::kAuto:
      return "auto";
    case Transport::kGloo:
      return "gloo";
    case Transport::kSharedMemory:
      return "shared_memory";
  }
  return "?";
}

const char* to_string(MpiProgress progress) {
  switch (progress) {
    case MpiProgress::kAuto:
      return "auto";
    case MpiProgress::kThread:
      return "thread";
    case MpiProgress::kCaller:
      return "caller";
  }
  return "?";
}

bool is_backend_available(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return true;
    case Backend::kNccl:
      return DTRAIN_HAS_NCCL != 0;
    case Backend::kMpi:
      return DTRAIN_HAS_MPI != 0;
  }
  return false;
}

WireStats wire_stats(const Communicator& comm) {
  // Every communicator make_communicator returns is a FrontEnd; anything else counts nothing.
  const auto* front = dynamic_cast<const detail::FrontEnd*>(&comm);
  return front != nullptr ? front->wire_stats() : WireStats{};
}

CommunicatorPtr make_communicator(std::shared_ptr<Store> store, int rank, int world_size,
                                  const CommunicatorOptions& options) {
  ErrorContext ctx{rank, world_size, "make_communicator", -1};
  if (!store) throw InvalidArgument(ctx, "store is null");
  if (world_size < 1) throw InvalidArgument(ctx, fmt::format("world_size {} < 1", world_size));
  if (rank < 0 || rank >= world_size)
    throw InvalidArgument(ctx, fmt::format("rank {} is not in [0, {})", rank, world_size));
  detail::check_options(options, ctx);
  auto failure = std::make_shared<detail::StickyFailure>();
  // NCCL's and MPI's bytes are not counted (wire_stats.h): they choose their algorithms
  // themselves, so their communicators report counted = false.
  auto wire = options.backend == Backend::kGloo ? std::make_shared<detail::WireCounter>() : nullptr;
  auto engine = detail::make_engine(store, rank, world_size, options, failure, wire, ctx);
  return std::make_shared<detail::FrontEnd>(rank, world_size, options, std::move(failure),
                                            std::move(engine), std::move(wire));
}

}  // namespace dtrain

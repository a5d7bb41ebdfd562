#include "comm/nccl/nccl_communicator.h"

#include <ATen/core/Tensor.h>

#include <cstring>

#include <fmt/format.h>

#include "comm/nccl/nccl_comm.h"
#include "comm/nccl/nccl_util.h"

namespace dtrain::nccl_backend {
namespace {

// The CUDA device this rank uses; also makes it current, as NCCL's init expects.
int resolve_device(const CommunicatorOptions& options, const ErrorContext& ctx) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    throw InvalidArgument(
        ctx, fmt::format("the NCCL backend needs a CUDA device: {}",
                         status != cudaSuccess ? cudaGetErrorString(status) : "none found"));
  }
  int device = options.device_index;
  if (device < 0) check_cuda(cudaGetDevice(&device), ctx, "cudaGetDevice");
  if (device >= count) {
    throw InvalidArgument(
        ctx, fmt::format("device_index {} is not a CUDA device of [0, {})", device, count));
  }
  use_device(device, ctx);
  return device;
}

// Rank 0 creates NCCL's unique id and publishes it through the store; the others wait for it
// until `deadline`.
ncclUniqueId exchange_unique_id(Store& store, int rank, Clock::time_point deadline,
                                const ErrorContext& ctx) {
  static const std::string kKey = "unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    check_nccl(ncclGetUniqueId(&id), ctx, "ncclGetUniqueId");
    const auto* bytes = reinterpret_cast<const uint8_t*>(id.internal);
    store.set(kKey, Bytes(bytes, bytes + sizeof(id.internal)));
    return id;
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  Bytes bytes;
  try {
    bytes = store.get(kKey, std::max(left, std::chrono::milliseconds(1)));
  } catch (const TimeoutError& e) {
    throw TimeoutError(ctx,
                       fmt::format("rank 0 did not publish the NCCL id in time ({})", e.cause()));
  } catch (const Error& e) {
    throw CommError(ctx, fmt::format("reading the NCCL id from the store: {}", e.cause()));
  }
  if (bytes.size() != sizeof(id.internal)) {
    throw CommError(ctx, fmt::format("the NCCL id in the store has {} bytes, expected {}",
                                     bytes.size(), sizeof(id.internal)));
  }
  std::memcpy(id.internal, bytes.data(), bytes.size());
  return id;
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// Whether `slice` is exactly rank's block of `flat` (NCCL's in-place all-gather and
// reduce-scatter layout).
bool is_rank_block(const at::Tensor& slice, const at::Tensor& flat, int rank) {
  return static_cast<const char*>(slice.data_ptr()) ==
         static_cast<const char*>(flat.data_ptr()) + rank * slice.nbytes();
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Store> store, int rank, int world_size,
                   const CommunicatorOptions& options)
      : rank_(rank),
        world_size_(world_size),
        options_(options),
        store_(make_prefix_store("dtrain/nccl/" + options.name, std::move(store))) {
    const ErrorContext ctx = context("connect");
    const auto deadline = Clock::now() + options.timeout;
    device_ = resolve_device(options, ctx);
    const ncclUniqueId id = exchange_unique_id(*store_, rank, deadline, ctx);
    comm_ = std::make_unique<NcclComm>(id, rank, world_size, device_, deadline, options.timeout);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Backend backend() const override { return Backend::kNccl; }
  uint64_t sequence_number() const override { return comm_->sequence_number(); }

  WorkPtr all_reduce(at::Tensor tensor, ReduceOp op, const CallOptions& options) override {
    check_tensor(tensor, "all_reduce", "tensor");
    const ncclDataType_t type = nccl_type(tensor.scalar_type(), context("all_reduce"));
    check_reduce_op(op, tensor, "all_reduce");
    void* data = tensor.data_ptr();
    const size_t n = static_cast<size_t>(tensor.numel());
    return comm_->launch("all_reduce", {tensor}, call_timeout(options), false,
                         [=](ncclComm_t comm, cudaStream_t stream) {
                           if (n == 0) return ncclSuccess;
                           return ncclAllReduce(data, data, n, type, nccl_op(op), comm, stream);
                         });
  }

  WorkPtr broadcast(at::Tensor tensor, int root, const CallOptions& options) override {
    check_tensor(tensor, "broadcast", "tensor");
    const ncclDataType_t type = nccl_type(tensor.scalar_type(), context("broadcast"));
    if (root < 0 || root >= world_size_) {
      throw InvalidArgument(context("broadcast"),
                            fmt::format("root {} is not a rank of [0, {})", root, world_size_));
    }
    void* data = tensor.data_ptr();
    const size_t n = static_cast<size_t>(tensor.numel());
    return comm_->launch("broadcast", {tensor}, call_timeout(options), false,
                         [=](ncclComm_t comm, cudaStream_t stream) {
                           if (n == 0) return ncclSuccess;
                           return ncclBroadcast(data, data, n, type, root, comm, stream);
                         });
  }

  WorkPtr all_gather(at::Tensor output, at::Tensor input, const CallOptions& options) override {
    check_tensor(output, "all_gather", "output");
    check_tensor(input, "all_gather", "input");
    const ncclDataType_t type = nccl_type(input.scalar_type(), context("all_gather"));
    if (output.scalar_type() != input.scalar_type() ||
        output.numel() != input.numel() * world_size_) {
      throw InvalidArgument(
          context("all_gather"),
          fmt::format(
              "output must have world_size * input.numel() = {} elements of {}, got {} of {}",
              input.numel() * world_size_, c10::toString(input.scalar_type()), output.numel(),
              c10::toString(output.scalar_type())));
    }
    if (overlap(input, output) && !is_rank_block(input, output, rank_)) {
      throw InvalidArgument(context("all_gather"),
                            "input overlaps output but is not this rank's block of it");
    }
    const void* in = input.data_ptr();
    void* out = output.data_ptr();
    const size_t n = static_cast<size_t>(input.numel());
    return comm_->launch("all_gather", {output, input}, call_timeout(options), false,
                         [=](ncclComm_t comm, cudaStream_t stream) {
                           if (n == 0) return ncclSuccess;
                           return ncclAllGather(in, out, n, type, comm, stream);
                         });
  }

  WorkPtr reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                         const CallOptions& options) override {
    check_tensor(output, "reduce_scatter", "output");
    check_tensor(input, "reduce_scatter", "input");
    const ncclDataType_t type = nccl_type(input.scalar_type(), context("reduce_scatter"));
    if (output.scalar_type() != input.scalar_type() ||
        input.numel() != output.numel() * world_size_) {
      throw InvalidArgument(
          context("reduce_scatter"),
          fmt::format("input must have world_size * output.numel() = {} elements of {}, got "
                      "{} of {} (pad with dtrain::padded_size)",
                      output.numel() * world_size_, c10::toString(output.scalar_type()),
                      input.numel(), c10::toString(input.scalar_type())));
    }
    check_reduce_op(op, input, "reduce_scatter");
    if (overlap(input, output) && !is_rank_block(output, input, rank_)) {
      throw InvalidArgument(context("reduce_scatter"),
                            "output overlaps input but is not this rank's block of it");
    }
    const void* in = input.data_ptr();
    void* out = output.data_ptr();
    const size_t n = static_cast<size_t>(output.numel());
    return comm_->launch("reduce_scatter", {output, input}, call_timeout(options), false,
                         [=](ncclComm_t comm, cudaStream_t stream) {
                           if (n == 0) return ncclSuccess;
                           return ncclReduceScatter(in, out, n, type, nccl_op(op), comm, stream);
                         });
  }

  // The Work of a barrier blocks the host in wait(): "every rank has called it" is a
  // statement about hosts, not streams.
  WorkPtr barrier(const CallOptions& options) override {
    void* data = comm_->barrier_buffer();
    return comm_->launch("barrier", {}, call_timeout(options), true,
                         [=](ncclComm_t comm, cudaStream_t stream) {
                           return ncclAllReduce(data, data, 1, ncclFloat32, ncclSum, comm, stream);
                         });
  }

  // NCCL has no tags: sends and receives between a pair match in issue order, and `tag` is
  // only checked by Gloo. See docs/nccl.md.
  WorkPtr send(at::Tensor tensor, int dst, uint32_t /*tag*/, const CallOptions& options) override {
    return point_to_point("send", std::move(tensor), dst, options, true);
  }
  WorkPtr recv(at::Tensor tensor, int src, uint32_t /*tag*/, const CallOptions& options) override {
    return point_to_point("recv", std::move(tensor), src, options, false);
  }

 private:
  ErrorContext context(const char* op) const { return ErrorContext{rank_, world_size_, op, -1}; }

  std::chrono::milliseconds call_timeout(const CallOptions& options) const {
    return options.timeout.count() > 0 ? options.timeout : options_.timeout;
  }

  void check_tensor(const at::Tensor& t, const char* op, const char* what) const {
    auto fail = [&](const std::string& why) {
      throw InvalidArgument(context(op), fmt::format("{}: {}", what, why));
    };
    if (!t.defined()) fail("undefined tensor");
    if (!t.is_cuda()) fail(fmt::format("NCCL needs CUDA tensors, got {}", t.device().str()));
    if (t.device().index() != device_) {
      fail(fmt::format("tensor is on {}, the communicator on cuda:{}", t.device().str(), device_));
    }
    if (t.layout() != c10::kStrided) fail("must be a dense (strided) tensor");
    if (!t.is_contiguous()) fail("must be contiguous");
  }

  void check_reduce_op(ReduceOp op, const at::Tensor& t, const char* op_name) const {
    if (op == ReduceOp::kAvg && !c10::isFloatingType(t.scalar_type())) {
      throw InvalidArgument(context(op_name), fmt::format("avg needs a floating dtype, got {}",
                                                          c10::toString(t.scalar_type())));
    }
  }

  WorkPtr point_to_point(const char* op, at::Tensor tensor, int peer, const CallOptions& options,
                         bool is_send) {
    check_tensor(tensor, op, "tensor");
    const ncclDataType_t type = nccl_type(tensor.scalar_type(), context(op));
    if (peer < 0 || peer >= world_size_ || peer == rank_) {
      throw InvalidArgument(context(op), fmt::format("peer rank {} is not another rank of [0, {})",
                                                     peer, world_size_));
    }
    void* data = tensor.data_ptr();
    const size_t n = static_cast<size_t>(tensor.numel());
    return comm_->launch(
        op, {tensor}, call_timeout(options), false, [=](ncclComm_t comm, cudaStream_t stream) {
          if (n == 0) return ncclSuccess;
          const ncclResult_t start = ncclGroupStart();
          if (start != ncclSuccess) return start;
          const ncclResult_t issued = is_send ? ncclSend(data, n, type, peer, comm, stream)
                                              : ncclRecv(data, n, type, peer, comm, stream);
          const ncclResult_t end = ncclGroupEnd();
          return issued != ncclSuccess ? issued : end;
        });
  }

  const int rank_;
  const int world_size_;
  const CommunicatorOptions options_;
  // Kept for the communicator's lifetime: rank 0's may host the TCP store server that
  // slower ranks still need to read the NCCL id.
  std::shared_ptr<Store> store_;
  int device_ = -1;
  std::unique_ptr<NcclComm> comm_;
};

}  // namespace

CommunicatorPtr make_nccl_communicator(std::shared_ptr<Store> store, int rank, int world_size,
                                       const CommunicatorOptions& options) {
  return std::make_shared<NcclCommunicator>(std::move(store), rank, world_size, options);
}

}  // namespace dtrain::nccl_backend

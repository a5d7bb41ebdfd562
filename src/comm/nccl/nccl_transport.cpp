#include "comm/nccl/nccl_transport.h"

#include <ATen/core/Tensor.h>

#include <unistd.h>

#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "comm/device_contract.h"
#include "comm/nccl/header_exchange.h"
#include "comm/nccl/nccl_comm.h"
#include "comm/nccl/nccl_util.h"
#include "comm/nccl/tag_policy.h"

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

std::string gpu_uuid(int device, const ErrorContext& ctx) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), ctx, "cudaGetDeviceProperties");
  std::string hex;
  for (int i = 0; i < 16; ++i) {
    hex += fmt::format("{:02x}", static_cast<uint8_t>(prop.uuid.bytes[i]));
    if (i == 3 || i == 5 || i == 7 || i == 9) hex += '-';
  }
  return "GPU-" + hex;
}

std::chrono::milliseconds time_left(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// The device contract across ranks (dtrain/rendezvous.h): NCCL refuses two ranks on one GPU
// with a cryptic "Duplicate GPU detected", or hangs, so the ranks compare their GPUs' UUIDs
// through the store first and all refuse with the same InvalidArgument. Rank 0 keeps the store
// (which it may serve) until every rank has read the claims.
void check_distinct_gpus(Store& store, int rank, int world_size, int device, int device_count,
                         Clock::time_point deadline, const ErrorContext& ctx) {
  if (world_size == 1) return;
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "?");
  const detail::GpuClaim mine{gpu_uuid(device, ctx), host, device, device_count};
  const std::string text = detail::serialize(mine);
  store.set(fmt::format("gpu/{}", rank), Bytes(text.begin(), text.end()));
  std::vector<detail::GpuClaim> claims;
  try {
    for (int r = 0; r < world_size; ++r) {
      const Bytes b = store.get(fmt::format("gpu/{}", r), time_left(deadline));
      claims.push_back(detail::parse_gpu_claim(std::string(b.begin(), b.end())));
    }
    store.set(fmt::format("gpu_read/{}", rank), Bytes{1});
  } catch (const TimeoutError& e) {
    throw TimeoutError(
        ctx, fmt::format("not every rank said which GPU it uses in time ({})", e.cause()));
  } catch (const std::invalid_argument& e) {
    throw CommError(ctx, e.what());
  }
  const auto shared = detail::find_shared_gpu(claims);
  if (!shared) return;
  if (rank == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < world_size; ++r) keys.push_back(fmt::format("gpu_read/{}", r));
    try {
      store.wait(keys, time_left(deadline));
    } catch (const Error&) {
      // Best effort: the others raise the same error, or a store error naming rank 0.
    }
  }
  throw InvalidArgument(ctx, *shared);
}

// Whether every call's header is exchanged: rank 0's CommunicatorOptions decide for all (a
// header exchange on some ranks only would pair with their peers' data collectives).
bool check_calls(Store& store, int rank, const CommunicatorOptions& options,
                 Clock::time_point deadline, const ErrorContext& ctx) {
  if (rank == 0) {
    const bool on = options.nccl_call_check || options.consistency == Consistency::kFingerprint;
    store.set("call_check", Bytes{static_cast<uint8_t>(on)});
    return on;
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  Bytes bytes;
  try {
    bytes = store.get("call_check", std::max(left, std::chrono::milliseconds(1)));
  } catch (const TimeoutError& e) {
    throw TimeoutError(
        ctx, fmt::format("rank 0 did not publish its call check in time ({})", e.cause()));
  } catch (const Error& e) {
    throw CommError(ctx, fmt::format("reading the call check from the store: {}", e.cause()));
  }
  return bytes.size() == 1 && bytes[0] != 0;
}

// Rank 0 creates NCCL's unique id and publishes it through the store; the others wait for it
// until `deadline`.
ncclUniqueId exchange_unique_id(Store& store, int rank, Clock::time_point deadline,
                                const ErrorContext& ctx, const std::string& kKey) {
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

using detail::Collective;
using detail::CollectiveOp;
using detail::PointToPoint;

class NcclTransport final : public detail::CollectiveEngine {
 public:
  NcclTransport(std::shared_ptr<Store> store, int rank, int world_size,
                const CommunicatorOptions& options, std::shared_ptr<detail::StickyFailure> failure)
      : rank_(rank),
        world_size_(world_size),
        store_(make_prefix_store("dtrain/nccl/" + options.name, std::move(store))) {
    const ErrorContext ctx{rank, world_size, "connect", -1};
    const auto deadline = Clock::now() + options.timeout;
    device_ = resolve_device(options, ctx);
    int count = 0;
    check_cuda(cudaGetDeviceCount(&count), ctx, "cudaGetDeviceCount");
    check_distinct_gpus(*store_, rank, world_size, device_, count, deadline, ctx);
    const ncclUniqueId id = exchange_unique_id(*store_, rank, deadline, ctx, "unique_id");
    comm_ = std::make_unique<NcclComm>(id, rank, world_size, device_, deadline, options.timeout,
                                       std::move(failure));
    if (world_size > 1 && check_calls(*store_, rank, options, deadline, ctx)) {
      const ncclUniqueId hid = exchange_unique_id(*store_, rank, deadline, ctx, "header_id");
      headers_ = std::make_shared<HeaderExchange>(hid, rank, world_size, device_, deadline);
    }
  }

  ~NcclTransport() override {
    // The data communicator first: it lets queued calls finish, and their header exchanges
    // are all done.
    comm_.reset();
    headers_.reset();
  }

  const char* name() const override { return "nccl"; }
  c10::Device device() const override {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
  }

  void check_tensor(const at::Tensor& t, const ErrorContext& ctx, const char* what) const override {
    auto fail = [&](const std::string& why) {
      throw InvalidArgument(ctx, fmt::format("{}: {}", what, why));
    };
    if (!t.is_cuda()) fail(fmt::format("NCCL needs CUDA tensors, got {}", t.device().str()));
    if (t.device().index() != device_) {
      fail(fmt::format("tensor is on {}, the communicator on cuda:{}", t.device().str(), device_));
    }
    (void)nccl_type(t.scalar_type(), ctx);
  }

  // NCCL's in-place layouts: a rank's block of the flat tensor, or no overlap at all.
  void check_call(const Collective& call) const override {
    if (call.op == CollectiveOp::kAllGather && overlap(call.input, call.tensor) &&
        !is_rank_block(call.input, call.tensor, rank_)) {
      throw InvalidArgument(call.context,
                            "input overlaps output but is not this rank's block of it");
    }
    if (call.op == CollectiveOp::kReduceScatter && overlap(call.input, call.tensor) &&
        !is_rank_block(call.tensor, call.input, rank_)) {
      throw InvalidArgument(call.context,
                            "output overlaps input but is not this rank's block of it");
    }
  }

  // Tags are refused, not ignored (tag_policy.h).
  void check_call(const PointToPoint& call) const override { check_tag(call.tag, call.context); }

  WorkPtr start(Collective call) override {
    const ErrorContext& ctx = call.context;
    const ncclDataType_t type =
        call.op == CollectiveOp::kBarrier ? ncclFloat32 : nccl_type(call.tensor.scalar_type(), ctx);
    void* out =
        call.op == CollectiveOp::kBarrier ? comm_->barrier_buffer() : call.tensor.data_ptr();
    const void* in = call.input.defined() ? call.input.data_ptr() : out;
    const size_t n = call.op == CollectiveOp::kBarrier ? 1
                     : call.op == CollectiveOp::kAllGather
                         ? static_cast<size_t>(call.input.numel())
                         : static_cast<size_t>(call.tensor.numel());
    const ncclRedOp_t op = nccl_op(call.reduce, world_size_);
    const int root = call.root;
    NcclComm::Call launch;
    switch (call.op) {
      case CollectiveOp::kAllReduce:
        launch = [=](ncclComm_t comm, cudaStream_t stream) {
          return n == 0 ? ncclSuccess : ncclAllReduce(out, out, n, type, op, comm, stream);
        };
        break;
      case CollectiveOp::kBroadcast:
        launch = [=](ncclComm_t comm, cudaStream_t stream) {
          return n == 0 ? ncclSuccess : ncclBroadcast(out, out, n, type, root, comm, stream);
        };
        break;
      case CollectiveOp::kAllGather:
        launch = [=](ncclComm_t comm, cudaStream_t stream) {
          return n == 0 ? ncclSuccess : ncclAllGather(in, out, n, type, comm, stream);
        };
        break;
      case CollectiveOp::kReduceScatter:
        launch = [=](ncclComm_t comm, cudaStream_t stream) {
          return n == 0 ? ncclSuccess : ncclReduceScatter(in, out, n, type, op, comm, stream);
        };
        break;
      case CollectiveOp::kBarrier:
        launch = [=](ncclComm_t comm, cudaStream_t stream) {
          return ncclAllReduce(out, out, 1, ncclFloat32, ncclSum, comm, stream);
        };
        break;
    }
    // The consistency check first, on the issuing thread under NcclComm's launch lock: its
    // DesyncError or TimeoutError fails this call's Work and breaks the communicator before
    // any data moved.
    if (headers_) {
      launch = [headers = headers_, header = call.header, timeout = call.timeout, ctx,
                data = std::move(launch)](ncclComm_t comm, cudaStream_t stream) {
        headers->run(header, timeout, ctx);
        return data(comm, stream);
      };
    }
    // The Work of a barrier blocks the host in wait(): "every rank has called it" is a
    // statement about hosts, not streams.
    const bool blocks_host = call.op == CollectiveOp::kBarrier;
    std::vector<at::Tensor> tensors;
    if (call.tensor.defined()) tensors.push_back(call.tensor);
    if (call.input.defined()) tensors.push_back(call.input);
    return comm_->launch(ctx, std::move(tensors), call.timeout, blocks_host, launch);
  }

  // NCCL has no tags: sends and receives between a pair match in issue order; check_call
  // refused every tag but 0. See docs/nccl.md.
  WorkPtr start(PointToPoint call) override {
    const ncclDataType_t type = nccl_type(call.tensor.scalar_type(), call.context);
    void* data = call.tensor.data_ptr();
    const size_t n = static_cast<size_t>(call.tensor.numel());
    const int peer = call.peer;
    const bool is_send = call.is_send;
    return comm_->launch(call.context, {call.tensor}, call.timeout, false,
                         [=](ncclComm_t comm, cudaStream_t stream) {
                           if (n == 0) return ncclSuccess;
                           const ncclResult_t start = ncclGroupStart();
                           if (start != ncclSuccess) return start;
                           const ncclResult_t issued =
                               is_send ? ncclSend(data, n, type, peer, comm, stream)
                                       : ncclRecv(data, n, type, peer, comm, stream);
                           const ncclResult_t end = ncclGroupEnd();
                           return issued != ncclSuccess ? issued : end;
                         });
  }

 private:
  const int rank_;
  const int world_size_;
  // Kept for the communicator's lifetime: rank 0's may host the TCP store server that
  // slower ranks still need to read the NCCL id.
  std::shared_ptr<Store> store_;
  int device_ = -1;
  std::unique_ptr<NcclComm> comm_;
  std::shared_ptr<HeaderExchange> headers_;  // null at world size 1
};

}  // namespace

std::unique_ptr<detail::CollectiveEngine> make_nccl_transport(
    std::shared_ptr<Store> store, int rank, int world_size, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure) {
  return std::make_unique<NcclTransport>(std::move(store), rank, world_size, options,
                                         std::move(failure));
}

}  // namespace dtrain::nccl_backend

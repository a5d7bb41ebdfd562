#include "support/nccl_contract.h"

#include <c10/core/Storage.h>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "support/ranks.h"

namespace dtrain::testing {
namespace {

bool is_nccl_dtype(c10::ScalarType t) {
  switch (t) {
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
    case at::kHalf:
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

}  // namespace

NcclContractCommunicator::NcclContractCommunicator(CommunicatorPtr inner)
    : inner_(std::move(inner)) {
  if (!inner_) throw InvalidArgument("NcclContractCommunicator: inner communicator is null");
}

void NcclContractCommunicator::check(const at::Tensor& t, const char* op, const char* what) {
  ++checked_;
  const c10::Device want = device();
  auto refuse = [&](const std::string& rule) {
    throw InvalidArgument(ErrorContext{rank(), world_size(), op, -1},
                          fmt::format("NCCL contract: {}: {}", what, rule));
  };
  if (!t.defined()) refuse("undefined tensor");
  const c10::Device d = t.device();
  if (d.type() != want.type() || (want.has_index() && d.index() != want.index())) {
    refuse(fmt::format("tensor on {}, NCCL takes only {} tensors", d.str(), want.str()));
  }
  if (t.layout() != c10::kStrided) refuse("not a dense (strided) tensor");
  if (!t.is_contiguous()) refuse("not contiguous");
  if (!is_nccl_dtype(t.scalar_type())) {
    refuse(fmt::format("dtype {} is not an NCCL dtype", c10::toString(t.scalar_type())));
  }
  if (!t.has_storage()) refuse("no storage");
  const c10::Storage& s = t.storage();
  if (s.nbytes() > 0 || t.numel() > 0) {
    if (s.allocator() == nullptr) {
      refuse(fmt::format("memory not from the {} allocator (wrapped host memory, e.g. from_blob)",
                         want.str()));
    }
    if (s.data_ptr().device().type() != want.type()) {
      refuse(fmt::format("memory on {} (host memory), not {}", s.data_ptr().device().str(),
                         want.str()));
    }
  }
}

WorkPtr NcclContractCommunicator::all_reduce(at::Tensor tensor, ReduceOp op,
                                             const CallOptions& options) {
  check(tensor, "all_reduce", "tensor");
  return inner_->all_reduce(std::move(tensor), op, options);
}

WorkPtr NcclContractCommunicator::broadcast(at::Tensor tensor, int root,
                                            const CallOptions& options) {
  check(tensor, "broadcast", "tensor");
  return inner_->broadcast(std::move(tensor), root, options);
}

WorkPtr NcclContractCommunicator::all_gather(at::Tensor output, at::Tensor input,
                                             const CallOptions& options) {
  check(output, "all_gather", "output");
  check(input, "all_gather", "input");
  return inner_->all_gather(std::move(output), std::move(input), options);
}

WorkPtr NcclContractCommunicator::reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                                                 const CallOptions& options) {
  check(output, "reduce_scatter", "output");
  check(input, "reduce_scatter", "input");
  return inner_->reduce_scatter(std::move(output), std::move(input), op, options);
}

WorkPtr NcclContractCommunicator::barrier(const CallOptions& options) {
  ++checked_;
  return inner_->barrier(options);
}

WorkPtr NcclContractCommunicator::send(at::Tensor tensor, int dst, uint32_t tag,
                                       const CallOptions& options) {
  check(tensor, "send", "tensor");
  return inner_->send(std::move(tensor), dst, tag, options);
}

WorkPtr NcclContractCommunicator::recv(at::Tensor tensor, int src, uint32_t tag,
                                       const CallOptions& options) {
  check(tensor, "recv", "tensor");
  return inner_->recv(std::move(tensor), src, tag, options);
}

std::shared_ptr<NcclContractCommunicator> make_nccl_contract_communicator(
    std::shared_ptr<Store> store, int rank, int world_size, c10::Device device,
    CommunicatorOptions options) {
  options.backend = Backend::kGloo;
  options.device = device;
  return std::make_shared<NcclContractCommunicator>(
      make_communicator(std::move(store), rank, world_size, options));
}

void run_contract_ranks(int world_size, c10::Device device,
                        const std::function<void(const CommunicatorPtr&)>& fn,
                        CommunicatorOptions options) {
  auto store = make_memory_store();
  run_threads(world_size, [&](int r) {
    CommunicatorPtr comm = make_nccl_contract_communicator(store, r, world_size, device, options);
    fn(comm);
  });
}

}  // namespace dtrain::testing

// A communicator that holds every call to NCCL's contract, for tests on machines without a
// GPU: whatever would make NCCL refuse a call (or read host memory as device memory) is
// refused here too, with InvalidArgument naming the call, the tensor and the rule. Calls that
// pass go to a Gloo communicator created for the same device, which stages them through host
// memory (CommunicatorOptions::device). With a device whose memory host code cannot read
// (support/fake_device.h) this proves on the CPU that a strategy hands its communicator
// only what NCCL accepts.
//
// The rules (NCCL 2.x, ncclDataType_t and the CUDA pointer checks):
//  * the tensor is on the configured device (a CPU tensor is host memory to NCCL);
//  * dense (strided) and contiguous;
//  * dtype int8, uint8, int32, int64, float16, float32, float64 or bfloat16 (NCCL's types as
//    LibTorch spells them; no bool, no complex);
//  * its memory comes from the device's allocator: not wrapped host memory (from_blob) and
//    not a storage whose data pointer is on another device.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <functional>
#include <memory>

#include "dtrain/communicator.h"
#include "dtrain/store.h"

namespace dtrain::testing {

class NcclContractCommunicator final : public Communicator {
 public:
  // `inner` must accept tensors of `inner->device()`, which becomes the configured device.
  explicit NcclContractCommunicator(CommunicatorPtr inner);

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Backend backend() const override { return inner_->backend(); }
  const char* transport_name() const override { return "nccl_contract"; }
  c10::Device device() const override { return inner_->device(); }
  uint64_t sequence_number() const override { return inner_->sequence_number(); }

  WorkPtr all_reduce(at::Tensor tensor, ReduceOp op, const CallOptions& options) override;
  WorkPtr broadcast(at::Tensor tensor, int root, const CallOptions& options) override;
  WorkPtr all_gather(at::Tensor output, at::Tensor input, const CallOptions& options) override;
  WorkPtr reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op,
                         const CallOptions& options) override;
  WorkPtr barrier(const CallOptions& options) override;
  WorkPtr send(at::Tensor tensor, int dst, uint32_t tag, const CallOptions& options) override;
  WorkPtr recv(at::Tensor tensor, int src, uint32_t tag, const CallOptions& options) override;

  // Calls checked so far (every call is checked; tests use it to see that the contract ran).
  int64_t checked_calls() const { return checked_; }

 private:
  // Throws InvalidArgument("NCCL contract: <op> <what>: <rule>") unless `t` obeys the rules.
  void check(const at::Tensor& t, const char* op, const char* what);

  CommunicatorPtr inner_;
  std::atomic<int64_t> checked_{0};
};

// A Gloo communicator for `device` (staged), held to NCCL's contract. `options.device` is
// replaced by `device`.
std::shared_ptr<NcclContractCommunicator> make_nccl_contract_communicator(
    std::shared_ptr<Store> store, int rank, int world_size, c10::Device device,
    CommunicatorOptions options = {});

// Runs fn(comm) on world_size threads, each with its own contract communicator for `device`
// over one in-memory store; rethrows the first exception (as run_ranks).
void run_contract_ranks(int world_size, c10::Device device,
                        const std::function<void(const CommunicatorPtr&)>& fn,
                        CommunicatorOptions options = {});

}  // namespace dtrain::testing

// The device contract's checks that need more than one process's view (see
// LaunchInfo::cuda_device in dtrain/rendezvous.h): whether two ranks ended up on the same
// physical GPU. Plain data, so that the verdict is testable without a GPU.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dtrain::detail {

// What one rank says about the GPU it uses.
struct GpuClaim {
  std::string uuid;      // the GPU's UUID: equal UUIDs are the same physical device
  std::string host;      // for the message only
  int device = -1;       // the CUDA device index in that rank's process
  int device_count = 0;  // devices that process sees
};

// "uuid\nhost\ndevice\ndevice_count" and back; parse throws std::invalid_argument on
// malformed input.
std::string serialize(const GpuClaim& claim);
GpuClaim parse_gpu_claim(const std::string& text);

// claims[r] is rank r's. When two ranks claim the same GPU: the cause of the
// InvalidArgument every rank raises (NCCL cannot run two ranks on one GPU), naming the
// first two such ranks, the host, how many GPUs it sees and what to change; else nullopt.
std::optional<std::string> find_shared_gpu(const std::vector<GpuClaim>& claims);

// What to change when ranks would share a GPU under NCCL: the end of every such message.
const char* shared_gpu_remedy();

}  // namespace dtrain::detail

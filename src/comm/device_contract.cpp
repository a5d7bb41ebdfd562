// The device contract (dtrain/rendezvous.h, LaunchInfo::cuda_device; docs/nccl.md, "Which GPU
// a rank uses"): the rule, the local refusal for NCCL, and the cross-rank verdict the NCCL
// backend applies to the GPUs' UUIDs.
#include "comm/device_contract.h"

#include <torch/cuda.h>

#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"

namespace dtrain {
namespace {

// Entries CUDA takes from CUDA_VISIBLE_DEVICES: comma-separated, up to the first empty or
// negative one (CUDA stops there, so "0,-1,2" shows one device).
int listed_devices(const std::string& list) {
  int n = 0;
  std::stringstream in(list);
  std::string entry;
  while (std::getline(in, entry, ',')) {
    const size_t first = entry.find_first_not_of(" \t");
    if (first == std::string::npos || entry[first] == '-') break;
    ++n;
  }
  return n;
}

std::string visible_note(const LaunchInfo& info) {
  return info.cuda_visible_devices
             ? fmt::format("CUDA_VISIBLE_DEVICES='{}'", *info.cuda_visible_devices)
             : std::string("CUDA_VISIBLE_DEVICES unset");
}

}  // namespace

bool LaunchInfo::narrowed_to_one_gpu() const {
  return cuda_visible_devices && listed_devices(*cuda_visible_devices) == 1;
}

int LaunchInfo::cuda_device(int device_count, Backend backend) const {
  const ErrorContext ctx{rank, world_size, "cuda_device", -1};
  if (device_count < 1) {
    throw InvalidArgument(ctx, fmt::format("no CUDA device is visible ({}, LibTorch sees {})",
                                           visible_note(*this), device_count));
  }
  if (narrowed_to_one_gpu()) return 0;
  if (backend == Backend::kNccl && local_world_size > device_count) {
    throw InvalidArgument(
        ctx, fmt::format("{} ranks on this host (LOCAL_WORLD_SIZE) but {} visible CUDA device(s) "
                         "({}): NCCL cannot run two ranks on one GPU; {}",
                         local_world_size, device_count, visible_note(*this),
                         detail::shared_gpu_remedy()));
  }
  return local_rank % device_count;
}

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

namespace detail {

const char* shared_gpu_remedy() {
  return "start at most one rank per GPU (fewer ranks per node: --nproc_per_node), give each "
         "rank its own GPU (CUDA_VISIBLE_DEVICES), or use the Gloo backend, which stages CUDA "
         "tensors through host memory and lets ranks share a GPU";
}

std::string serialize(const GpuClaim& claim) {
  return fmt::format("{}\n{}\n{}\n{}", claim.uuid, claim.host, claim.device, claim.device_count);
}

GpuClaim parse_gpu_claim(const std::string& text) {
  std::stringstream in(text);
  GpuClaim c;
  std::string device, count;
  if (!std::getline(in, c.uuid) || !std::getline(in, c.host) || !std::getline(in, device) ||
      !std::getline(in, count) || c.uuid.empty()) {
    throw std::invalid_argument("malformed GPU claim: '" + text + "'");
  }
  c.device = std::stoi(device);
  c.device_count = std::stoi(count);
  return c;
}

std::optional<std::string> find_shared_gpu(const std::vector<GpuClaim>& claims) {
  for (size_t a = 0; a < claims.size(); ++a) {
    for (size_t b = a + 1; b < claims.size(); ++b) {
      if (claims[a].uuid != claims[b].uuid) continue;
      return fmt::format(
          "ranks {} and {} would both use GPU {} on host {} (cuda:{} and cuda:{}; that process "
          "sees {} CUDA device(s)): NCCL cannot run two ranks on one GPU; {}",
          a, b, claims[a].uuid, claims[a].host, claims[a].device, claims[b].device,
          claims[a].device_count, shared_gpu_remedy());
    }
  }
  return std::nullopt;
}

}  // namespace detail
}  // namespace dtrain

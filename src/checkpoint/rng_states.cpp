#include "checkpoint/rng_states.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "comm/control_plane.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"

namespace dtrain::checkpoint {
namespace {

// A Generator is a handle: copies share the generator and its mutex.
at::Tensor state_of(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_state(at::Generator g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// [u32 cpu bytes][cpu][u32 cuda count]{[u32 bytes][state]}: one rank's states as one message.
void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void put_state(std::string& out, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  put_u32(out, static_cast<uint32_t>(c.nbytes()));
  out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::string pack(const RngStates& s) {
  std::string out;
  put_state(out, s.cpu);
  put_u32(out, static_cast<uint32_t>(s.cuda.size()));
  for (const auto& t : s.cuda) put_state(out, t);
  return out;
}

RngStates unpack(const char* p, size_t n) {
  size_t at = 0;
  auto u32 = [&] {
    if (at + 4 > n) throw CheckpointError("truncated generator states from a rank");
    uint32_t v;
    std::memcpy(&v, p + at, 4);
    at += 4;
    return v;
  };
  auto state = [&] {
    const uint32_t len = u32();
    if (at + len > n) throw CheckpointError("truncated generator states from a rank");
    at::Tensor t = at::empty({static_cast<int64_t>(len)}, at::kByte);
    std::memcpy(t.data_ptr(), p + at, len);
    at += len;
    return t;
  };
  RngStates s;
  s.cpu = state();
  const uint32_t count = u32();
  for (uint32_t d = 0; d < count; ++d) s.cuda.push_back(state());
  return s;
}

}  // namespace

Generators Generators::process_defaults() {
  Generators g;
  g.cpu = at::detail::getDefaultCPUGenerator();
  // Through ATen's context, which reaches the CUDA hooks without CUDA headers; a LibTorch
  // without CUDA sees no device and never asks.
  const int devices = cuda_device_count();
  for (int d = 0; d < devices; ++d) {
    g.cuda.push_back(at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d))));
  }
  return g;
}

RngStates capture(const Generators& generators) {
  RngStates s;
  s.cpu = state_of(generators.cpu);
  for (const auto& g : generators.cuda) s.cuda.push_back(state_of(g));
  return s;
}

std::vector<RngStates> gather_rng_states(Communicator* comm, const RngStates& mine) {
  const std::string bytes = pack(mine);
  if (comm == nullptr || comm->world_size() == 1) return {mine};
  // Ranks may see different numbers of GPUs: the control plane gathers bytes of any length.
  const std::vector<std::string> all = ControlPlane(*comm).all_gather_bytes(bytes);
  if (comm->rank() != 0) return {};
  std::vector<RngStates> out;
  for (const std::string& b : all) out.push_back(unpack(b.data(), b.size()));
  return out;
}

void append_rng_entries(int rank, const RngStates& states,
                        std::vector<std::pair<std::string, at::Tensor>>& extra) {
  extra.emplace_back(fmt::format("rng/cpu/{}", rank), states.cpu);
  extra.emplace_back(fmt::format("rng/cuda_count/{}", rank),
                     at::full({1}, static_cast<int64_t>(states.cuda.size()), at::kLong));
  for (size_t d = 0; d < states.cuda.size(); ++d) {
    extra.emplace_back(fmt::format("rng/cuda/{}/{}", rank, d), states.cuda[d]);
  }
}

std::optional<RngStates> read_rng_entries(SafetensorsReader& extra, int rank) {
  const std::string cpu = fmt::format("rng/cpu/{}", rank);
  if (extra.find(cpu) == nullptr) return std::nullopt;
  RngStates s;
  s.cpu = extra.read(cpu);
  const std::string count_key = fmt::format("rng/cuda_count/{}", rank);
  if (extra.find(count_key) == nullptr) return s;  // written before CUDA states were saved
  const at::Tensor count = extra.read(count_key);
  if (count.scalar_type() != at::kLong || count.numel() != 1 || count.item<int64_t>() < 0 ||
      count.item<int64_t>() > 4096) {
    throw CheckpointError(
        fmt::format("{}: {} must be one int64 in [0, 4096]", extra.path(), count_key));
  }
  for (int64_t d = 0; d < count.item<int64_t>(); ++d) {
    const std::string key = fmt::format("rng/cuda/{}/{}", rank, d);
    if (extra.find(key) == nullptr) {
      throw CheckpointError(fmt::format("{}: {} says {} CUDA generator(s) but {} is missing",
                                        extra.path(), count_key, count.item<int64_t>(), key));
    }
    s.cuda.push_back(extra.read(key));
  }
  return s;
}

CudaRestore restore(const Generators& generators, const RngStates& states) {
  set_state(generators.cpu, states.cpu);
  if (generators.cuda.empty() && states.cuda.empty()) return CudaRestore::kNone;
  if (generators.cuda.size() != states.cuda.size()) return CudaRestore::kCountDiffers;
  for (size_t d = 0; d < states.cuda.size(); ++d) set_state(generators.cuda[d], states.cuda[d]);
  return CudaRestore::kRestored;
}

}  // namespace dtrain::checkpoint

#include "checkpoint/rank_state.h"

#include <ATen/ATen.h>

#include <cstring>

#include <fmt/format.h>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint {
namespace {

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

class Cursor {
 public:
  explicit Cursor(const std::string& bytes) : bytes_(bytes) {}
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }
  const char* take(size_t n) {
    if (at_ + n > bytes_.size()) throw CheckpointError("truncated per-rank state from a rank");
    const char* p = bytes_.data() + at_;
    at_ += n;
    return p;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  const std::string& bytes_;
  size_t at_ = 0;
};

std::string prefix(int rank) { return fmt::format("rank_state/{}/", rank); }

}  // namespace

// [u32 count]{[u32 name bytes][name][i32 dtype][u32 dims]{[i64 size]}[u64 bytes][data]}
std::string pack_rank_state(const NamedTensors& state) {
  std::string out;
  put<uint32_t>(out, static_cast<uint32_t>(state.size()));
  for (const auto& [name, t] : state) {
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    put<uint32_t>(out, static_cast<uint32_t>(name.size()));
    out += name;
    put<int32_t>(out, static_cast<int32_t>(c.scalar_type()));
    put<uint32_t>(out, static_cast<uint32_t>(c.dim()));
    for (int64_t d : c.sizes()) put<int64_t>(out, d);
    put<uint64_t>(out, static_cast<uint64_t>(c.nbytes()));
    out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  return out;
}

NamedTensors unpack_rank_state(const std::string& bytes) {
  Cursor in(bytes);
  NamedTensors out;
  const uint32_t count = in.get<uint32_t>();
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t len = in.get<uint32_t>();
    std::string name(in.take(len), len);
    const auto dtype = static_cast<c10::ScalarType>(in.get<int32_t>());
    std::vector<int64_t> shape(in.get<uint32_t>());
    for (auto& d : shape) d = in.get<int64_t>();
    const uint64_t n = in.get<uint64_t>();
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
    if (t.nbytes() != n) throw CheckpointError("malformed per-rank state from a rank");
    std::memcpy(t.data_ptr(), in.take(n), n);
    out[name] = t;
  }
  if (!in.done()) throw CheckpointError("malformed per-rank state from a rank");
  return out;
}

std::vector<NamedTensors> gather_rank_states(Communicator* comm, const NamedTensors& mine) {
  if (comm == nullptr || comm->world_size() == 1) return {mine};
  const c10::Device device = comm->device();
  const auto on_device = [&](at::ScalarType dtype, int64_t n) {
    return at::empty({n}, at::TensorOptions().dtype(dtype).device(device));
  };
  if (comm->rank() != 0) {
    const std::string bytes = pack_rank_state(mine);
    const int64_t n = static_cast<int64_t>(bytes.size());
    at::Tensor length = at::full({1}, n, at::kLong).to(device);
    comm->send(length, 0)->wait();
    at::Tensor data = at::empty({n}, at::kByte);
    std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
    comm->send(data.to(device), 0)->wait();
    return {};
  }
  std::vector<NamedTensors> all(static_cast<size_t>(comm->world_size()));
  all[0] = mine;
  for (int r = 1; r < comm->world_size(); ++r) {
    at::Tensor length = on_device(at::kLong, 1);
    comm->recv(length, r)->wait();
    const int64_t n = length.to(at::kCPU).item<int64_t>();
    at::Tensor data = on_device(at::kByte, n);
    comm->recv(data, r)->wait();
    const at::Tensor host = data.to(at::kCPU);
    all[static_cast<size_t>(r)] =
        unpack_rank_state(std::string(static_cast<const char*>(host.data_ptr()), n));
  }
  return all;
}

void append_rank_state_entries(int rank, const NamedTensors& state,
                               std::vector<std::pair<std::string, at::Tensor>>& extra) {
  for (const auto& [name, t] : state) extra.emplace_back(prefix(rank) + name, t);
}

std::optional<NamedTensors> read_rank_state_entries(SafetensorsReader& extra, int rank) {
  const std::string p = prefix(rank);
  NamedTensors out;
  for (const auto& t : extra.tensors()) {
    if (t.name.compare(0, p.size(), p) == 0) out[t.name.substr(p.size())] = extra.read(t.name);
  }
  if (out.empty()) return std::nullopt;
  return out;
}

}  // namespace dtrain::checkpoint

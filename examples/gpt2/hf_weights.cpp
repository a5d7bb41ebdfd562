#include "hf_weights.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/communicator.h"
#include "dtrain/errors.h"
#include "dtrain/safetensors.h"

namespace gpt2 {
namespace {

using dtrain::SafetensorsReader;
using dtrain::SafetensorsTensor;
using dtrain::StateSlice;

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Weights stored by Hugging Face's Conv1D: [in, out], the transpose of Linear's.
bool is_conv1d_weight(const std::string& name) {
  for (const char* t :
       {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    if (ends_with(name, t)) return true;
  }
  return false;
}

// The shape Hugging Face stores our parameter `name` of `shape` in.
std::vector<int64_t> hf_shape(const std::string& name, const std::vector<int64_t>& shape) {
  if (is_conv1d_weight(name) && shape.size() == 2) return {shape[1], shape[0]};
  return shape;
}

// The file's tensor for our parameter `name` of `shape`, checked: present (with or without
// the "transformer." prefix) and of the matching shape.
const SafetensorsTensor& find_checked(const SafetensorsReader& reader, const std::string& path,
                                      const std::string& name, const std::vector<int64_t>& shape) {
  const SafetensorsTensor* t = reader.find("transformer." + name);
  if (t == nullptr) t = reader.find(name);
  if (t == nullptr) {
    throw dtrain::CheckpointError(
        fmt::format("{}: no tensor transformer.{} (is it a GPT-2 checkpoint?)", path, name));
  }
  if (t->shape != hf_shape(name, shape)) {
    throw dtrain::CheckpointError(fmt::format(
        "{}: {} has shape [{}] but the model's {} needs [{}] (other --layers/--dim/--vocab?)", path,
        t->name, fmt::join(t->shape, ", "), name, fmt::join(shape, ", ")));
  }
  return *t;
}

// Elements [b, e) of our flattened parameter `name` (our `shape`) from the file's tensor `t`
// into `out` (1-D, e - b elements, any dtype and device), reading only those elements' bytes.
// A Conv1D weight is stored transposed: our rows [r0, r1) are the file's columns [r0, r1),
// one contiguous run in each of the file's rows (at most two of our rows more than asked).
void read_range(SafetensorsReader& reader, const SafetensorsTensor& t, const std::string& name,
                const std::vector<int64_t>& shape, int64_t b, int64_t e, const at::Tensor& out) {
  if (e <= b) return;
  const auto opts = at::TensorOptions().dtype(t.dtype);
  const auto item = static_cast<uint64_t>(c10::elementSize(t.dtype));
  at::Tensor flat;
  if (!is_conv1d_weight(name)) {
    flat = at::empty({e - b}, opts);
    reader.read_bytes(t, static_cast<uint64_t>(b) * item, flat.data_ptr(),
                      static_cast<size_t>(e - b) * item);
  } else {
    const int64_t rows = shape[0], cols = shape[1];  // ours; the file's is [cols, rows]
    const int64_t r0 = b / cols, r1 = (e - 1) / cols + 1;
    at::Tensor part = at::empty({cols, r1 - r0}, opts);  // the file's columns [r0, r1)
    auto* dst = static_cast<char*>(part.data_ptr());
    const auto run = static_cast<size_t>(r1 - r0) * item;
    for (int64_t i = 0; i < cols; ++i) {
      reader.read_bytes(t, static_cast<uint64_t>(i * rows + r0) * item, dst + i * run, run);
    }
    flat = part.t().contiguous().view({-1}).narrow(0, b - r0 * cols, e - b);
  }
  c10::NoGradGuard no_grad;
  out.copy_(flat);
}

// The elements [b, e) of a slice this rank sends to the export: replicas split their range
// evenly, so that every element comes from exactly one rank.
std::pair<int64_t, int64_t> export_range(const StateSlice& s) {
  const int64_t n = s.end - s.begin;
  return {s.begin + n * s.replica / s.num_replicas, s.begin + n * (s.replica + 1) / s.num_replicas};
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> to_hf_gpt2(
    const std::vector<std::pair<std::string, at::Tensor>>& ours) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, t] : ours) {
    at::Tensor v = t.detach().to(at::kFloat).cpu();
    out.emplace_back("transformer." + name, is_conv1d_weight(name) ? v.t().contiguous() : v);
  }
  return out;
}

void export_hf_safetensors(const std::string& path,
                           const std::vector<std::pair<std::string, at::Tensor>>& params) {
  dtrain::write_safetensors(path, to_hf_gpt2(params), {{"format", "pt"}});
}

void init_from_hf_safetensors(const std::string& path, Gpt& model) {
  c10::NoGradGuard no_grad;
  SafetensorsReader reader(path);
  auto params = model->named_parameters(true);
  std::vector<const SafetensorsTensor*> found;
  for (auto& item : params) {
    found.push_back(&find_checked(reader, path, item.key(), item.value().sizes().vec()));
  }
  size_t i = 0;
  for (auto& item : params) {
    read_range(reader, *found[i], item.key(), item.value().sizes().vec(), 0, item.value().numel(),
               item.value().view({-1}));
    reader.release(*found[i++]);  // the mapped copy would double the model in RSS
  }
}

HfLoadStats load_hf_safetensors(const std::string& path, dtrain::Strategy& strategy) {
  SafetensorsReader reader(path);
  dtrain::StateLayout layout = strategy.state_layout();
  // Every rank checks every parameter before reading anything: a bad file fails on all
  // ranks alike, with nothing written into the model.
  std::vector<const SafetensorsTensor*> found(layout.slices.size(), nullptr);
  for (size_t i = 0; i < layout.slices.size(); ++i) {
    const StateSlice& s = layout.slices[i];
    if (s.kind == StateSlice::Kind::kBuffer) continue;
    found[i] = &find_checked(reader, path, s.name, s.shape);
  }
  HfLoadStats stats;
  for (size_t i = 0; i < layout.slices.size(); ++i) {
    const StateSlice& s = layout.slices[i];
    if (found[i] == nullptr) continue;
    read_range(reader, *found[i], s.name, s.shape, s.begin, s.end, s.data);
    // A Conv1D shard's strided reads map every page of the tensor: drop them, so the
    // rank's RSS grows by its shard, not by the tensors it read from.
    reader.release(*found[i]);
    if (s.end > s.begin) ++stats.tensors;
    stats.elements += s.end - s.begin;
  }
  strategy.state_loaded();
  stats.bytes_read = static_cast<int64_t>(reader.bytes_read());
  return stats;
}

int64_t export_hf_safetensors(const std::string& path, dtrain::Strategy& strategy) {
  dtrain::StateLayout layout = strategy.state_layout();
  std::vector<const StateSlice*> params;
  for (const StateSlice& s : layout.slices) {
    if (s.kind != StateSlice::Kind::kBuffer) params.push_back(&s);
  }
  const size_t n = params.size();
  dtrain::Communicator* comm = layout.comm.get();
  const int rank = comm != nullptr ? comm->rank() : 0;
  const int world = comm != nullptr ? comm->world_size() : 1;
  const c10::Device device = comm != nullptr ? comm->device() : c10::Device(c10::kCPU);

  // Every rank's export ranges, so that rank 0 knows whom to receive each tensor from.
  at::Tensor mine = at::empty({static_cast<int64_t>(2 * n)}, at::kLong);
  auto* my_ranges = mine.data_ptr<int64_t>();
  for (size_t k = 0; k < n; ++k) {
    const auto [b, e] = export_range(*params[k]);
    my_ranges[2 * k] = b;
    my_ranges[2 * k + 1] = e;
  }
  at::Tensor ranges = mine;
  if (world > 1) {
    at::Tensor out =
        at::empty({world * mine.numel()}, at::TensorOptions().dtype(at::kLong).device(device));
    comm->all_gather_sync(out, mine.to(device));
    ranges = out.cpu();
  }
  const auto* rg = ranges.data_ptr<int64_t>();
  auto range_of = [&](int r, size_t k) {
    return std::make_pair(rg[r * 2 * n + 2 * k], rg[r * 2 * n + 2 * k + 1]);
  };

  if (rank != 0) {
    for (size_t k = 0; k < n; ++k) {
      const auto [b, e] = range_of(rank, k);
      if (e <= b) continue;
      const StateSlice& s = *params[k];
      comm->send(s.data.narrow(0, b - s.begin, e - b).contiguous().to(device), 0)->wait();
    }
    return 0;
  }
  std::vector<SafetensorsTensor> file_layout;
  for (const StateSlice* s : params) {
    SafetensorsTensor t;
    t.name = "transformer." + s->name;
    t.dtype = at::kFloat;
    t.shape = hf_shape(s->name, s->shape);
    file_layout.push_back(std::move(t));
  }
  dtrain::SafetensorsWriter writer(path, file_layout, {{"format", "pt"}});
  for (size_t k = 0; k < n; ++k) {
    const StateSlice& s = *params[k];
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    // One whole tensor at a time, assembled from the ranks' ranges.
    at::Tensor whole = at::empty({numel}, at::TensorOptions().dtype(s.dtype).device(device));
    std::vector<std::pair<int64_t, int64_t>> got;
    for (int r = 0; r < world; ++r) {
      const auto [b, e] = range_of(r, k);
      if (e <= b) continue;
      got.emplace_back(b, e);
      if (r == 0) {
        whole.narrow(0, b, e - b).copy_(s.data.narrow(0, b - s.begin, e - b));
      } else {
        comm->recv(whole.narrow(0, b, e - b), r)->wait();
      }
    }
    std::sort(got.begin(), got.end());
    int64_t covered = 0;
    for (const auto& [b, e] : got) {
      if (b != covered) break;
      covered = e;
    }
    if (covered != numel) {
      throw dtrain::InvalidArgument(
          dtrain::ErrorContext{0, world, "export_hf_safetensors", -1},
          fmt::format("the ranks' slices of {} do not cover it exactly", s.name));
    }
    at::Tensor v = whole.view(s.shape).to(at::kFloat).cpu();
    writer.write(is_conv1d_weight(s.name) ? v.t().contiguous() : v.contiguous());
  }
  writer.finish();
  return static_cast<int64_t>(n);
}

}  // namespace gpt2

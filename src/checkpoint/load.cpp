// load_checkpoint: every rank reads, for each slice of its StateLayout, the overlapping
// pieces of whichever files hold them (layout.h), checks everything into staging tensors,
// and writes into the model and optimizer only once every rank has succeeded.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/agreement.h"
#include "checkpoint/directory.h"
#include "checkpoint/layout.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/rank_state.h"
#include "checkpoint/rng_states.h"
#include "checkpoint/safetensors.h"
#include "dtrain/checkpoint.h"
#include "dtrain/errors.h"
#include "dtrain/json.h"

namespace dtrain {
namespace ck = checkpoint;
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;
using ck::kExtraFile;
using ck::model_key;
using ck::optim_key;
using ck::OptimizerAdapter;
using ck::ParamOptState;
using ck::Ranks;
using ck::shape_string;

// One loaded checkpoint on one rank: the manifest, an index of pieces by key, and readers
// opened (and verified) on demand.
class CheckpointReader {
 public:
  explicit CheckpointReader(std::string path) : path_(std::move(path)) {
    manifest_ = ck::read_manifest(path_);
    manifest_path_ = (fs::path(path_) / ck::kManifestName).string();
    try {
      if (manifest_.at("format").as_string() != "dtrain-checkpoint")
        fail("not a dtrain checkpoint");
      for (const auto& [file, entry] : manifest_.at("files").as_object()) {
        if (file.find('/') != std::string::npos || file.empty() || file[0] == '.') {
          fail(fmt::format("bad file name \"{}\"", file));
        }
        digests_[file] = ck::digest_from_json(entry);
        for (const auto& p : entry.at("pieces").as_array()) {
          const auto& a = p.as_array();
          if (a.size() != 3) fail("a piece is not [key, begin, end]");
          pieces_[a[0].as_string()].push_back({file, a[1].as_int(), a[2].as_int()});
        }
      }
    } catch (const JsonError& e) {
      fail(e.cause());
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw CheckpointError(fmt::format("{}: {}", manifest_path_, what));
  }
  const Json& manifest() const { return manifest_; }

  SafetensorsReader& file(const std::string& name) {
    auto it = readers_.find(name);
    if (it != readers_.end()) return *it->second;
    auto d = digests_.find(name);
    if (d == digests_.end()) fail(fmt::format("no file \"{}\" in the manifest", name));
    auto reader = std::make_unique<SafetensorsReader>(SafetensorsAccess::open(
        std::make_unique<ck::VerifiedFile>((fs::path(path_) / name).string(), d->second)));
    return *readers_.emplace(name, std::move(reader)).first->second;
  }

  // Elements [b, e) of tensor `key` (flattened) into `out` (1-D, e - b elements).
  void read(const std::string& key, int64_t b, int64_t e, at::Tensor& out) {
    if (e <= b) return;
    auto it = pieces_.find(key);
    int64_t covered = 0;
    if (it != pieces_.end()) {
      const size_t item = out.element_size();
      for (const auto& p : it->second) {
        const int64_t lo = std::max(b, p.begin), hi = std::min(e, p.end);
        if (hi <= lo) continue;
        SafetensorsReader& r = file(p.file);
        const SafetensorsTensor* t = r.find(key);
        if (t == nullptr || t->numel() != p.end - p.begin || t->dtype != out.scalar_type()) {
          throw CheckpointError(fmt::format(
              "{}: tensor \"{}\" is missing or does not match the manifest ({} elements of {} "
              "expected)",
              r.path(), key, p.end - p.begin, c10::toString(out.scalar_type())));
        }
        r.read_bytes(*t, static_cast<uint64_t>(lo - p.begin) * item,
                     static_cast<char*>(out.data_ptr()) + (lo - b) * item,
                     static_cast<size_t>(hi - lo) * item);
        covered += hi - lo;
      }
    }
    if (covered != e - b) {
      fail(fmt::format("elements [{}, {}) of \"{}\" are not in the checkpoint's files", b, e, key));
    }
  }

  int64_t bytes_read() const {
    int64_t n = 0;
    for (const auto& [name, r] : readers_)
      n += static_cast<int64_t>(SafetensorsAccess::source(*r).bytes_read());
    return n;
  }

 private:
  struct Piece {
    std::string file;
    int64_t begin, end;
  };
  std::string path_, manifest_path_;
  Json manifest_;
  std::map<std::string, ck::FileDigest> digests_;
  std::map<std::string, std::vector<Piece>> pieces_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;
};

}  // namespace

TrainingState load_checkpoint(const std::string& path, Strategy& strategy,
                              torch::optim::Optimizer* optimizer, const LoadOptions& options,
                              CheckpointStats* stats) {
  const auto t0 = Clock::now();
  StateLayout layout = strategy.state_layout();
  const Ranks ranks(layout.comm);
  const OptimizerAdapter opt(optimizer);
  const size_t T = layout.slices.size();

  // Everything is read and checked into staging tensors first; the model and optimizer are
  // written only once every rank has succeeded.
  TrainingState result;
  std::vector<at::Tensor> data(T);
  std::vector<std::vector<at::Tensor>> opt_state(T);
  std::vector<int64_t> steps(T, -1);
  std::vector<double> lrs;
  std::optional<ck::RngStates> rng;
  std::optional<ck::NamedTensors> rank_state;
  int64_t bytes = 0;
  ranks.agreed("load_checkpoint", [&] {
    CheckpointReader reader(path);
    const Json& m = reader.manifest();
    try {
      std::map<std::string, const Json*> saved;
      for (const auto& t : m.at("tensors").as_array()) saved[t.at("name").as_string()] = &t;
      for (const auto& s : layout.slices) {
        auto it = saved.find(s.name);
        if (it == saved.end()) {
          reader.fail(fmt::format("model mismatch: the checkpoint has no tensor \"{}\" ({} {})",
                                  s.name, safetensors_dtype_name(s.dtype), shape_string(s.shape)));
        }
        const Json& t = *it->second;
        std::vector<int64_t> shape;
        for (const auto& d : t.at("shape").as_array()) shape.push_back(d.as_int());
        const std::string dtype = t.at("dtype").as_string();
        if (shape != s.shape || dtype != safetensors_dtype_name(s.dtype)) {
          reader.fail(fmt::format(
              "model mismatch: tensor \"{}\" is {} {} in the checkpoint but {} {} in the model",
              s.name, dtype, shape_string(shape), safetensors_dtype_name(s.dtype),
              shape_string(s.shape)));
        }
        saved.erase(it);
      }
      if (!saved.empty()) {
        reader.fail(fmt::format("model mismatch: the model has no tensor \"{}\" of the checkpoint",
                                saved.begin()->first));
      }
      const Json& o = m.at("optimizer");
      if (opt.active()) {
        if (o.type() == Json::Type::kNull) {
          reader.fail("the checkpoint holds no optimizer state (load it with a null optimizer)");
        }
        if (o.at("type").as_string() != opt.type_name()) {
          reader.fail(
              fmt::format("optimizer mismatch: the checkpoint holds {} state, the "
                          "optimizer is {}",
                          o.at("type").as_string(), opt.type_name()));
        }
        std::vector<std::string> kinds;
        for (const auto& k : o.at("state").as_array()) kinds.push_back(k.as_string());
        if (kinds != opt.kinds()) {
          reader.fail(
              fmt::format("optimizer mismatch: the checkpoint holds state [{}], the "
                          "optimizer keeps [{}] (amsgrad or momentum differ)",
                          fmt::join(kinds, ", "), fmt::join(opt.kinds(), ", ")));
        }
        for (const auto& lr : o.at("lr").as_array()) lrs.push_back(lr.as_double());
        // As PyTorch's Optimizer.load_state_dict: groups are matched by position, so another
        // count means the optimizer was built differently.
        if (lrs.size() != opt.group_count()) {
          reader.fail(fmt::format(
              "optimizer mismatch: the checkpoint has {} parameter group(s), the optimizer {}",
              lrs.size(), opt.group_count()));
        }
      }
      std::map<std::string, int64_t> step_of;
      for (const auto& t : m.at("tensors").as_array()) {
        const Json& st = t.at("optimizer_step");
        if (st.type() != Json::Type::kNull) step_of[t.at("name").as_string()] = st.as_int();
      }
      for (size_t i = 0; i < T; ++i) {
        const StateSlice& s = layout.slices[i];
        data[i] = at::empty({s.end - s.begin}, at::TensorOptions().dtype(s.dtype));
        reader.read(model_key(s.name), s.begin, s.end, data[i]);
        auto st = step_of.find(s.name);
        if (!opt.active() || !s.stepped.defined() || st == step_of.end()) continue;
        steps[i] = st->second;
        for (const auto& kind : opt.kinds()) {
          // Host memory, which the reader fills; applied to the state's device below.
          at::Tensor t =
              at::empty({s.end - s.begin}, at::TensorOptions().dtype(s.stepped.scalar_type()));
          reader.read(optim_key(s.name, kind), s.begin, s.end, t);
          opt_state[i].push_back(t);
        }
      }
      result.step = m.at("step").as_int();
      for (const auto& [k, v] : m.at("values").as_object()) result.values[k] = v.as_string();
      SafetensorsReader& extra = reader.file(kExtraFile);
      for (const auto& t : extra.tensors()) {
        if (t.name.rfind("training/", 0) == 0) {
          result.tensors[t.name.substr(9)] = extra.read(t.name);
        }
      }
      if (options.restore_rng && m.at("world_size").as_int() == ranks.world) {
        rng = ck::read_rng_entries(extra, ranks.rank);
      }
      // A rank's own state belongs to the same rank of the same world size only.
      if (layout.load_rank_state && m.at("world_size").as_int() == ranks.world) {
        rank_state = ck::read_rank_state_entries(extra, ranks.rank);
      }
    } catch (const JsonError& e) {
      reader.fail(fmt::format("unreadable manifest: {}", e.cause()));
    }
    bytes = reader.bytes_read();
  });

  // Apply: nothing below reads files or can fail on bad input.
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < T; ++i) layout.slices[i].data.copy_(data[i]);
    if (opt.active()) {
      // Optimizer state is per stepped tensor (a parameter, or an FSDP unit's flat shard).
      std::map<const void*, std::vector<size_t>> by_stepped;
      for (size_t i = 0; i < T; ++i) {
        if (layout.slices[i].stepped.defined()) {
          by_stepped[layout.slices[i].stepped.unsafeGetTensorImpl()].push_back(i);
        }
      }
      for (const auto& [impl, indices] : by_stepped) {
        const at::Tensor& stepped = layout.slices[indices.front()].stepped;
        ParamOptState st;
        for (size_t i : indices) {
          if (steps[i] < 0) continue;
          st.present = true;
          st.step = std::max(st.step, steps[i]);
        }
        if (st.present) {
          for (size_t k = 0; k < opt.kinds().size(); ++k) {
            at::Tensor full = at::zeros_like(stepped, stepped.options().requires_grad(false));
            at::Tensor flat = full.view({-1});
            for (size_t i : indices) {
              const StateSlice& s = layout.slices[i];
              if (steps[i] < 0) continue;
              flat.narrow(0, s.stepped_offset, s.end - s.begin).copy_(opt_state[i][k]);
            }
            st.tensors.push_back(full);
          }
        }
        opt.set(stepped, std::move(st));
      }
      opt.set_learning_rates(lrs);
    }
    if (rng) ck::restore(ck::Generators::process_defaults(), *rng);
    if (rank_state) layout.load_rank_state(*rank_state);
  }
  strategy.state_loaded();
  if (stats != nullptr) {
    stats->path = path;
    stats->bytes = bytes;
    stats->seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return result;
}

}  // namespace dtrain

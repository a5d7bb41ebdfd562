// save_checkpoint / load_checkpoint: the strategies' StateLayout (which flattened elements
// of which tensor a rank holds) written as pieces into safetensors files, and read back
// piece by piece for whatever layout the loading strategy has.
//
// Keys of the pieces: "model/<name>" for parameters and buffers, "optim/<name>/<kind>" for
// the optimizer state of a parameter (kind: exp_avg, exp_avg_sq, max_exp_avg_sq,
// momentum_buffer), "training/<name>" and the generators ("rng/...", rng_states.h) in
// extra.safetensors. A piece
// [begin, end) holds those flattened elements of its tensor; the full form writes each
// tensor whole, in its own shape, as one piece [0, numel).
#include "dtrain/checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/directory.h"
#include "checkpoint/json.h"
#include "checkpoint/rng_states.h"
#include "checkpoint/safetensors.h"
#include "comm/control_plane.h"
#include "compat/torch_compat.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace ck = checkpoint;
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;
using Kind = StateSlice::Kind;

// Point-to-point tag of the full form's gather: 0, because NCCL has no tags and refuses any
// other (docs/nccl.md); the gather's sends and receives match in issue order, and nothing
// else sends between steps.
constexpr uint32_t kTag = 0;
constexpr const char* kExtraFile = "extra.safetensors";
constexpr const char* kFullFile = "model.safetensors";

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kParameter:
      return "parameter";
    case Kind::kFrozenParameter:
      return "frozen";
    case Kind::kBuffer:
      return "buffer";
  }
  return "?";
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- optimizer state, for the optimizers LibTorch ships that checkpoints support ----

enum class OptType { kNone, kAdamW, kAdam, kSgd };

struct ParamOptState {
  bool present = false;
  int64_t step = 0;
  std::vector<at::Tensor> tensors;  // one per OptimizerAdapter::kinds, full shape of the param
};

class OptimizerAdapter {
 public:
  explicit OptimizerAdapter(torch::optim::Optimizer* opt) : opt_(opt) {
    if (opt_ == nullptr) return;
    const auto& options = opt_->param_groups().at(0).options();
    if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
      type_ = OptType::kAdamW;
      kinds_ = {"exp_avg", "exp_avg_sq"};
      if (o->amsgrad()) kinds_.push_back("max_exp_avg_sq");
    } else if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
      type_ = OptType::kAdam;
      kinds_ = {"exp_avg", "exp_avg_sq"};
      if (a->amsgrad()) kinds_.push_back("max_exp_avg_sq");
    } else if (auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
      type_ = OptType::kSgd;
      if (s->momentum() != 0) kinds_ = {"momentum_buffer"};
    } else {
      throw InvalidArgument(
          "checkpoint: unsupported optimizer (AdamW, Adam and SGD are supported); pass a null "
          "optimizer to save or load the model alone");
    }
  }

  bool active() const { return type_ != OptType::kNone; }
  const char* type_name() const {
    switch (type_) {
      case OptType::kAdamW:
        return "AdamW";
      case OptType::kAdam:
        return "Adam";
      case OptType::kSgd:
        return "SGD";
      case OptType::kNone:
        break;
    }
    return "none";
  }
  const std::vector<std::string>& kinds() const { return kinds_; }

  ParamOptState get(const at::Tensor& p) const {
    ParamOptState out;
    auto& state = opt_->state();
    auto it = state.find(compat::optimizer_state_key(state, p));
    if (it == state.end()) return out;
    out.present = true;
    auto defined_or_zeros = [&](const at::Tensor& t) {
      return t.defined() && t.numel() == p.numel() ? t : at::zeros_like(p);
    };
    if (type_ == OptType::kAdamW) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      out.step = s.step();
      out.tensors = {s.exp_avg(), s.exp_avg_sq()};
      if (kinds_.size() == 3) out.tensors.push_back(defined_or_zeros(s.max_exp_avg_sq()));
    } else if (type_ == OptType::kAdam) {
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
      out.step = s.step();
      out.tensors = {s.exp_avg(), s.exp_avg_sq()};
      if (kinds_.size() == 3) out.tensors.push_back(defined_or_zeros(s.max_exp_avg_sq()));
    } else if (!kinds_.empty()) {
      const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
      out.tensors = {defined_or_zeros(s.momentum_buffer())};
    }
    return out;
  }

  // Replaces p's state (or removes it when !s.present).
  void set(const at::Tensor& p, ParamOptState s) const {
    auto& state = opt_->state();
    auto key = compat::optimizer_state_key(state, p);
    state.erase(key);
    if (!s.present) return;
    if (type_ == OptType::kAdamW) {
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      st->step(s.step);
      st->exp_avg(s.tensors[0]);
      st->exp_avg_sq(s.tensors[1]);
      if (kinds_.size() == 3) st->max_exp_avg_sq(s.tensors[2]);
      state[key] = std::move(st);
    } else if (type_ == OptType::kAdam) {
      auto st = std::make_unique<torch::optim::AdamParamState>();
      st->step(s.step);
      st->exp_avg(s.tensors[0]);
      st->exp_avg_sq(s.tensors[1]);
      if (kinds_.size() == 3) st->max_exp_avg_sq(s.tensors[2]);
      state[key] = std::move(st);
    } else {
      auto st = std::make_unique<torch::optim::SGDParamState>();
      if (!s.tensors.empty()) st->momentum_buffer(s.tensors[0]);
      state[key] = std::move(st);
    }
  }

  std::vector<double> learning_rates() const {
    std::vector<double> out;
    for (auto& g : opt_->param_groups()) out.push_back(g.options().get_lr());
    return out;
  }
  size_t group_count() const { return opt_->param_groups().size(); }
  // Callers check the group count first (load_checkpoint refuses a mismatch).
  void set_learning_rates(const std::vector<double>& lrs) const {
    auto& groups = opt_->param_groups();
    for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lrs.at(i));
  }

 private:
  torch::optim::Optimizer* opt_;
  OptType type_ = OptType::kNone;
  std::vector<std::string> kinds_;
};

// ---- collectives over the strategy's communicator (none for one rank) ----

struct Ranks {
  Communicator* comm = nullptr;
  int rank = 0, world = 1;

  explicit Ranks(const CommunicatorPtr& c) : comm(c.get()) {
    if (comm != nullptr) {
      rank = comm->rank();
      world = comm->world_size();
    }
  }
  bool many() const { return world > 1; }
  // Where the communicator takes tensors (the CPU without one).
  c10::Device device() const { return comm != nullptr ? comm->device() : c10::Device(c10::kCPU); }
  ErrorContext ctx(const char* op) const { return ErrorContext{rank, world, op, -1}; }

  // Runs fn on every rank; if it failed anywhere, every rank throws (the local error where
  // there is one), so that no rank goes on to a step the others will not take.
  template <typename Fn>
  void agreed(const char* what, Fn&& fn) const {
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    if (many()) {
      const int64_t failed =
          ControlPlane(*comm).all_reduce_value(error ? int64_t{1} : int64_t{0}, ReduceOp::kMax);
      if (!error && failed != 0) {
        throw CheckpointError(ctx(what), "another rank failed (see its error)");
      }
    }
    if (error) std::rethrow_exception(error);
  }
};

// ---- what a rank saves ----

struct SliceState {
  std::vector<at::Tensor> opt;  // per kind, 1-D over the slice's range; undefined when none
};

// The elements [wb, we) of a slice this rank writes: replicas split a range evenly.
std::pair<int64_t, int64_t> write_range(const StateSlice& s) {
  const int64_t n = s.end - s.begin;
  return {s.begin + n * s.replica / s.num_replicas, s.begin + n * (s.replica + 1) / s.num_replicas};
}

std::string model_key(const std::string& name) { return "model/" + name; }
std::string optim_key(const std::string& name, const std::string& kind) {
  return "optim/" + name + "/" + kind;
}
std::string rank_file(int rank) { return fmt::format("rank{:05d}.safetensors", rank); }
std::string sidecar_file(int rank) { return fmt::format("rank{:05d}.json", rank); }

}  // namespace

std::string latest_checkpoint(const std::string& dir) { return ck::latest_complete(dir); }

CheckpointStats save_checkpoint(const std::string& dir, Strategy& strategy,
                                torch::optim::Optimizer* optimizer, const TrainingState& state,
                                const CheckpointOptions& options) {
  const auto t0 = Clock::now();
  StateLayout layout = strategy.state_layout();
  const Ranks ranks(layout.comm);
  if (options.keep < 1) throw InvalidArgument(ranks.ctx("save_checkpoint"), "keep must be >= 1");
  if (state.step < 0) throw InvalidArgument(ranks.ctx("save_checkpoint"), "step must be >= 0");
  const OptimizerAdapter opt(optimizer);
  const auto& kinds = opt.kinds();
  const size_t T = layout.slices.size(), K = kinds.size();
  auto progress = [&](const char* point) {
    if (options.on_progress) options.on_progress(point);
  };

  // This rank's optimizer state per slice, and the ranks' agreement on which tensors have
  // state and their step counts (a rank whose shard never got a gradient has none).
  std::vector<SliceState> local(T);
  std::vector<int64_t> agree(2 * T, 0);
  if (opt.active()) {
    auto& a = agree;
    for (size_t i = 0; i < T; ++i) {
      const StateSlice& s = layout.slices[i];
      if (!s.stepped.defined()) continue;
      ParamOptState st = opt.get(s.stepped);
      if (!st.present) continue;
      a[2 * i] = 1;
      a[2 * i + 1] = st.step;
      for (const auto& t : st.tensors) {
        local[i].opt.push_back(
            t.detach().reshape({-1}).narrow(0, s.stepped_offset, s.end - s.begin));
      }
    }
    if (ranks.many()) agree = ControlPlane(*ranks.comm).all_reduce(agree, ReduceOp::kMax);
  }
  const std::vector<int64_t>& agreed_state = agree;
  auto has_state = [&](size_t i) { return agreed_state[2 * i] != 0; };
  // The pieces this rank writes, in one order on every rank: (slice, kind or -1 for data).
  auto piece_data = [&](size_t i, int k) -> at::Tensor {
    const StateSlice& s = layout.slices[i];
    const auto [wb, we] = write_range(s);
    if (k < 0) return s.data.narrow(0, wb - s.begin, we - wb);
    if (local[i].opt.empty()) return at::zeros({we - wb}, s.stepped.options().requires_grad(false));
    return local[i].opt[static_cast<size_t>(k)].narrow(0, wb - s.begin, we - wb);
  };
  auto piece_key = [&](size_t i, int k) {
    return k < 0 ? model_key(layout.slices[i].name)
                 : optim_key(layout.slices[i].name, kinds[static_cast<size_t>(k)]);
  };
  std::vector<std::pair<size_t, int>> items;
  for (size_t i = 0; i < T; ++i) {
    items.emplace_back(i, -1);
    if (has_state(i)) {
      for (size_t k = 0; k < K; ++k) items.emplace_back(i, static_cast<int>(k));
    }
  }

  // Every rank's random generators (CPU and CUDA), to rank 0.
  const std::vector<ck::RngStates> all_rng = ck::gather_rng_states(
      ranks.many() ? ranks.comm : nullptr, ck::capture(ck::Generators::process_defaults()));

  const std::string tmp = ck::temp_path(dir, state.step);
  CheckpointStats stats;
  ranks.agreed("save_checkpoint: prepare", [&] {
    if (ranks.rank == 0) ck::prepare_temp(dir, state.step);
  });
  progress("tmp_created");

  ck::Json files = ck::Json::object();  // rank 0: name -> digest + pieces
  auto file_entry = [](const ck::FileDigest& d, ck::Json pieces) {
    ck::Json j = ck::digest_to_json(d);
    j.set("pieces", std::move(pieces));
    return j;
  };
  const bool full = options.format == CheckpointFormat::kFull;
  ranks.agreed("save_checkpoint: write", [&] {
    if (!full) {
      // Sharded: this rank's pieces into its own file, described by a sidecar for rank 0.
      std::vector<ck::SafetensorsTensor> file_layout;
      ck::Json pieces{ck::Json::Array{}};
      std::vector<at::Tensor> data;
      for (const auto& [i, k] : items) {
        at::Tensor t = piece_data(i, k);
        if (t.numel() == 0) continue;
        const auto [wb, we] = write_range(layout.slices[i]);
        ck::SafetensorsTensor info;
        info.name = piece_key(i, k);
        info.dtype = t.scalar_type();
        info.shape = {t.numel()};
        file_layout.push_back(info);
        pieces.push_back(
            ck::Json(ck::Json::Array{ck::Json(info.name), ck::Json(wb), ck::Json(we)}));
        data.push_back(t);
      }
      ck::Json sidecar = ck::Json::object();
      if (!data.empty()) {
        ck::SafetensorsWriter w((fs::path(tmp) / rank_file(ranks.rank)).string(), file_layout);
        for (size_t n = 0; n < data.size(); ++n) {
          if (n == data.size() / 2) progress("mid_file");
          w.write(data[n]);
        }
        const ck::FileDigest d = w.finish();
        stats.bytes += static_cast<int64_t>(d.size);
        sidecar.set(rank_file(ranks.rank), file_entry(d, std::move(pieces)));
      }
      ck::write_small_file((fs::path(tmp) / sidecar_file(ranks.rank)).string(), sidecar.dump());
    } else {
      // Full: rank 0 receives every other rank's pieces tensor by tensor and writes each
      // tensor whole; no rank holds more than one full tensor at a time.
      std::vector<int64_t> mine;
      for (const auto& s : layout.slices) {
        const auto [wb, we] = write_range(s);
        mine.push_back(wb);
        mine.push_back(we);
      }
      const std::vector<int64_t> rg =
          ranks.many() ? ControlPlane(*ranks.comm).all_gather(mine) : mine;
      auto range_of = [&](int r, size_t i) {
        return std::make_pair(rg[r * 2 * T + 2 * i], rg[r * 2 * T + 2 * i + 1]);
      };
      if (ranks.rank == 0) {
        std::vector<ck::SafetensorsTensor> file_layout;
        ck::Json pieces{ck::Json::Array{}};
        for (const auto& [i, k] : items) {
          const StateSlice& s = layout.slices[i];
          ck::SafetensorsTensor info;
          info.name = piece_key(i, k);
          info.dtype = k < 0 ? s.dtype : s.stepped.scalar_type();
          info.shape = s.shape;
          file_layout.push_back(info);
          pieces.push_back(ck::Json(ck::Json::Array{ck::Json(info.name), ck::Json(int64_t{0}),
                                                    ck::Json(numel_of(s.shape))}));
        }
        ck::SafetensorsWriter w((fs::path(tmp) / kFullFile).string(), file_layout);
        for (size_t n = 0; n < items.size(); ++n) {
          const auto [i, k] = items[n];
          if (n == items.size() / 2) progress("mid_file");
          const ck::SafetensorsTensor& info = file_layout[n];
          // On the communicator's device: the pieces arrive there (the writer copies to host).
          at::Tensor buf = at::empty({numel_of(info.shape)},
                                     at::TensorOptions().dtype(info.dtype).device(ranks.device()));
          // Each element must come from exactly one rank (a strategy bug otherwise).
          std::vector<std::pair<int64_t, int64_t>> got;
          for (int r = 0; r < ranks.world; ++r) {
            const auto [b, e] = range_of(r, i);
            if (e <= b) continue;
            got.emplace_back(b, e);
            if (r == 0) {
              buf.narrow(0, b, e - b).copy_(piece_data(i, k));
            } else {
              ranks.comm->recv(buf.narrow(0, b, e - b), r, kTag)->wait();
            }
          }
          std::sort(got.begin(), got.end());
          int64_t covered = 0;
          for (const auto& [b, e] : got) {
            if (b != covered) break;
            covered = e;
          }
          if (covered != buf.numel()) {
            throw InvalidArgument(
                ranks.ctx("save_checkpoint"),
                fmt::format("the ranks' slices of '{}' do not cover it exactly", info.name));
          }
          w.write(buf);
        }
        const ck::FileDigest d = w.finish();
        stats.bytes += static_cast<int64_t>(d.size);
        files.set(kFullFile, file_entry(d, std::move(pieces)));
      } else {
        for (const auto& [i, k] : items) {
          at::Tensor t = piece_data(i, k).contiguous();
          if (t.numel() > 0) ranks.comm->send(t.to(ranks.device()), 0, kTag)->wait();
        }
      }
    }
    if (ranks.rank == 0) {
      // Caller state and every rank's generator: small, written by rank 0.
      std::vector<std::pair<std::string, at::Tensor>> extra;
      for (const auto& [name, t] : state.tensors) extra.emplace_back("training/" + name, t);
      for (int r = 0; r < ranks.world; ++r) {
        ck::append_rng_entries(r, all_rng[static_cast<size_t>(r)], extra);
      }
      const ck::FileDigest d = ck::write_safetensors((fs::path(tmp) / kExtraFile).string(), extra);
      stats.bytes += static_cast<int64_t>(d.size);
      files.set(kExtraFile, file_entry(d, ck::Json(ck::Json::Array{})));
    }
  });
  progress("files_written");

  ranks.agreed("save_checkpoint: commit", [&] {
    if (ranks.rank != 0) return;
    if (!full) {
      for (int r = 0; r < ranks.world; ++r) {
        const std::string side = (fs::path(tmp) / sidecar_file(r)).string();
        const ck::Json j = ck::Json::parse(ck::read_small_file(side, ck::kMaxManifestBytes));
        for (const auto& [name, entry] : j.as_object()) files.set(name, entry);
        fs::remove(side);
      }
    }
    ck::Json m = ck::Json::object();
    m.set("format", "dtrain-checkpoint");
    m.set("version", ck::kFormatVersion);
    m.set("step", state.step);
    m.set("form", full ? "full" : "sharded");
    m.set("strategy", strategy.name());
    m.set("sharding", layout.sharding);
    m.set("world_size", ranks.world);
    ck::Json tensors{ck::Json::Array{}};
    for (size_t i = 0; i < T; ++i) {
      const StateSlice& s = layout.slices[i];
      ck::Json t = ck::Json::object();
      t.set("name", s.name);
      t.set("kind", kind_name(s.kind));
      t.set("dtype", ck::safetensors_dtype_name(s.dtype));
      ck::Json::Array shape;
      for (int64_t d : s.shape) shape.emplace_back(d);
      t.set("shape", ck::Json(std::move(shape)));
      t.set("optimizer_step", has_state(i) ? ck::Json(agreed_state[2 * i + 1]) : ck::Json());
      tensors.push_back(std::move(t));
    }
    m.set("tensors", std::move(tensors));
    if (opt.active()) {
      ck::Json o = ck::Json::object();
      o.set("type", opt.type_name());
      ck::Json::Array k, lrs;
      for (const auto& kind : kinds) k.emplace_back(kind);
      for (double lr : opt.learning_rates()) lrs.emplace_back(lr);
      o.set("state", ck::Json(std::move(k)));
      o.set("lr", ck::Json(std::move(lrs)));
      m.set("optimizer", std::move(o));
    } else {
      m.set("optimizer", ck::Json());
    }
    ck::Json training = ck::Json::object();
    for (const auto& [k, v] : state.values) training.set(k, v);
    m.set("values", std::move(training));
    m.set("files", std::move(files));
    ck::write_manifest(tmp, m);
    ck::commit_temp(dir, state.step, options.on_progress);
    ck::prune(dir, options.keep);
  });
  stats.path = (fs::path(dir) / ck::step_dir_name(state.step)).string();
  stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return stats;
}

namespace {

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
    } catch (const ck::JsonError& e) {
      fail(e.what());
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw CheckpointError(fmt::format("{}: {}", manifest_path_, what));
  }
  const ck::Json& manifest() const { return manifest_; }

  ck::SafetensorsReader& file(const std::string& name) {
    auto it = readers_.find(name);
    if (it != readers_.end()) return *it->second;
    auto d = digests_.find(name);
    if (d == digests_.end()) fail(fmt::format("no file \"{}\" in the manifest", name));
    auto reader = std::make_unique<ck::SafetensorsReader>(
        std::make_unique<ck::VerifiedFile>((fs::path(path_) / name).string(), d->second));
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
        ck::SafetensorsReader& r = file(p.file);
        const ck::SafetensorsTensor* t = r.find(key);
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
    for (const auto& [name, r] : readers_) n += static_cast<int64_t>(r->source().bytes_read());
    return n;
  }

 private:
  struct Piece {
    std::string file;
    int64_t begin, end;
  };
  std::string path_, manifest_path_;
  ck::Json manifest_;
  std::map<std::string, ck::FileDigest> digests_;
  std::map<std::string, std::vector<Piece>> pieces_;
  std::map<std::string, std::unique_ptr<ck::SafetensorsReader>> readers_;
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
  int64_t bytes = 0;
  ranks.agreed("load_checkpoint", [&] {
    CheckpointReader reader(path);
    const ck::Json& m = reader.manifest();
    try {
      std::map<std::string, const ck::Json*> saved;
      for (const auto& t : m.at("tensors").as_array()) saved[t.at("name").as_string()] = &t;
      for (const auto& s : layout.slices) {
        auto it = saved.find(s.name);
        if (it == saved.end()) {
          reader.fail(fmt::format("model mismatch: the checkpoint has no tensor \"{}\" ({} {})",
                                  s.name, ck::safetensors_dtype_name(s.dtype),
                                  shape_string(s.shape)));
        }
        const ck::Json& t = *it->second;
        std::vector<int64_t> shape;
        for (const auto& d : t.at("shape").as_array()) shape.push_back(d.as_int());
        const std::string dtype = t.at("dtype").as_string();
        if (shape != s.shape || dtype != ck::safetensors_dtype_name(s.dtype)) {
          reader.fail(fmt::format(
              "model mismatch: tensor \"{}\" is {} {} in the checkpoint but {} {} in the model",
              s.name, dtype, shape_string(shape), ck::safetensors_dtype_name(s.dtype),
              shape_string(s.shape)));
        }
        saved.erase(it);
      }
      if (!saved.empty()) {
        reader.fail(fmt::format("model mismatch: the model has no tensor \"{}\" of the checkpoint",
                                saved.begin()->first));
      }
      const ck::Json& o = m.at("optimizer");
      if (opt.active()) {
        if (o.type() == ck::Json::Type::kNull) {
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
        const ck::Json& st = t.at("optimizer_step");
        if (st.type() != ck::Json::Type::kNull) step_of[t.at("name").as_string()] = st.as_int();
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
      ck::SafetensorsReader& extra = reader.file(kExtraFile);
      for (const auto& t : extra.tensors()) {
        if (t.name.rfind("training/", 0) == 0) {
          result.tensors[t.name.substr(9)] = extra.read(t.name);
        }
      }
      if (options.restore_rng && m.at("world_size").as_int() == ranks.world) {
        rng = ck::read_rng_entries(extra, ranks.rank);
      }
    } catch (const ck::JsonError& e) {
      reader.fail(fmt::format("unreadable manifest: {}", e.what()));
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

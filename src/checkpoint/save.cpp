// save_checkpoint: the strategy's StateLayout (which flattened elements of which tensor a
// rank holds) written as pieces (layout.h) into safetensors files: in the sharded form each
// rank its own file (write_sharded), in the full form rank 0 one file with every tensor
// whole (write_full); then rank 0 writes the manifest and makes the checkpoint visible.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "checkpoint/agreement.h"
#include "checkpoint/directory.h"
#include "dtrain/json.h"
#include "checkpoint/layout.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/rng_states.h"
#include "checkpoint/safetensors.h"
#include "dtrain/checkpoint.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace ck = checkpoint;
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;
using ck::OptimizerAdapter;
using ck::ParamOptState;
using ck::Ranks;

// One piece this rank writes: the elements [wb, we) of a tensor (its data, or one kind of
// its optimizer state), 1-D.
struct Piece {
  size_t slice = 0;
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;  // the whole tensor's
  int64_t wb = 0, we = 0;
  at::Tensor data;
};

// What one save writes on one rank, in one order on every rank.
struct SavePlan {
  std::string tmp;  // the temporary directory
  bool full = false;
  std::vector<Piece> pieces;
  std::function<void(const char*)> progress;
};

Json file_entry(const ck::FileDigest& d, Json pieces) {
  Json j = ck::digest_to_json(d);
  j.set("pieces", std::move(pieces));
  return j;
}

// Sharded: this rank's pieces into its own file, described by a sidecar for rank 0.
int64_t write_sharded(const SavePlan& plan, int rank) {
  std::vector<SafetensorsTensor> file_layout;
  Json pieces{Json::Array{}};
  std::vector<at::Tensor> data;
  for (const Piece& p : plan.pieces) {
    if (p.data.numel() == 0) continue;
    SafetensorsTensor info;
    info.name = p.key;
    info.dtype = p.data.scalar_type();
    info.shape = {p.data.numel()};
    file_layout.push_back(info);
    pieces.push_back(Json(Json::Array{Json(info.name), Json(p.wb), Json(p.we)}));
    data.push_back(p.data);
  }
  int64_t bytes = 0;
  Json sidecar = Json::object();
  if (!data.empty()) {
    SafetensorsWriter w((fs::path(plan.tmp) / ck::rank_file(rank)).string(), file_layout);
    for (size_t n = 0; n < data.size(); ++n) {
      if (n == data.size() / 2) plan.progress("mid_file");
      w.write(data[n]);
    }
    const ck::FileDigest d = ck::SafetensorsAccess::finish(w);
    bytes += static_cast<int64_t>(d.size);
    sidecar.set(ck::rank_file(rank), file_entry(d, std::move(pieces)));
  }
  ck::write_small_file((fs::path(plan.tmp) / ck::sidecar_file(rank)).string(), sidecar.dump());
  return bytes;
}

// Full: rank 0 receives every other rank's pieces tensor by tensor and writes each tensor
// whole; no rank holds more than one full tensor at a time. Returns rank 0's file entry.
Json write_full(const SavePlan& plan, const Ranks& ranks, int64_t* bytes) {
  const size_t n_items = plan.pieces.size();
  std::vector<int64_t> mine;
  for (const Piece& p : plan.pieces) {
    mine.push_back(p.wb);
    mine.push_back(p.we);
  }
  const std::vector<int64_t> rg = ranks.many() ? ControlPlane(*ranks.comm).all_gather(mine) : mine;
  auto range_of = [&](int r, size_t n) {
    return std::make_pair(rg[r * 2 * n_items + 2 * n], rg[r * 2 * n_items + 2 * n + 1]);
  };
  if (ranks.rank != 0) {
    for (const Piece& p : plan.pieces) {
      at::Tensor t = p.data.contiguous();
      if (t.numel() > 0) ranks.comm->send(t.to(ranks.device()), 0, ck::kTag)->wait();
    }
    return Json();
  }
  std::vector<SafetensorsTensor> file_layout;
  Json pieces{Json::Array{}};
  for (const Piece& p : plan.pieces) {
    SafetensorsTensor info;
    info.name = p.key;
    info.dtype = p.dtype;
    info.shape = p.shape;
    file_layout.push_back(info);
    pieces.push_back(Json(
        Json::Array{Json(info.name), Json(int64_t{0}), Json(ck::numel_of(p.shape))}));
  }
  SafetensorsWriter w((fs::path(plan.tmp) / ck::kFullFile).string(), file_layout);
  for (size_t n = 0; n < n_items; ++n) {
    if (n == n_items / 2) plan.progress("mid_file");
    const SafetensorsTensor& info = file_layout[n];
    // On the communicator's device: the pieces arrive there (the writer copies to host).
    at::Tensor buf = at::empty({ck::numel_of(info.shape)},
                               at::TensorOptions().dtype(info.dtype).device(ranks.device()));
    // Each element must come from exactly one rank (a strategy bug otherwise).
    std::vector<std::pair<int64_t, int64_t>> got;
    for (int r = 0; r < ranks.world; ++r) {
      const auto [b, e] = range_of(r, n);
      if (e <= b) continue;
      got.emplace_back(b, e);
      if (r == 0) {
        buf.narrow(0, b, e - b).copy_(plan.pieces[n].data);
      } else {
        ranks.comm->recv(buf.narrow(0, b, e - b), r, ck::kTag)->wait();
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
  const ck::FileDigest d = ck::SafetensorsAccess::finish(w);
  *bytes += static_cast<int64_t>(d.size);
  return file_entry(d, std::move(pieces));
}

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
  SavePlan plan;
  plan.full = options.format == CheckpointFormat::kFull;
  plan.progress = [&](const char* point) {
    if (options.on_progress) options.on_progress(point);
  };

  // This rank's optimizer state per slice (per kind, 1-D over the slice's range), and the
  // ranks' agreement on which tensors have state and their step counts (a rank whose shard
  // never got a gradient has none).
  std::vector<std::vector<at::Tensor>> local(T);
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
        local[i].push_back(t.detach().reshape({-1}).narrow(0, s.stepped_offset, s.end - s.begin));
      }
    }
    if (ranks.many()) agree = ControlPlane(*ranks.comm).all_reduce(agree, ReduceOp::kMax);
  }
  const std::vector<int64_t>& agreed_state = agree;
  auto has_state = [&](size_t i) { return agreed_state[2 * i] != 0; };
  // The pieces this rank writes, in one order on every rank: each slice's data, then its
  // optimizer state by kind.
  for (size_t i = 0; i < T; ++i) {
    const StateSlice& s = layout.slices[i];
    const auto [wb, we] = ck::write_range(s);
    Piece p;
    p.slice = i;
    p.key = ck::model_key(s.name);
    p.dtype = s.dtype;
    p.shape = s.shape;
    p.wb = wb;
    p.we = we;
    p.data = s.data.narrow(0, wb - s.begin, we - wb);
    plan.pieces.push_back(p);
    if (!has_state(i)) continue;
    for (size_t k = 0; k < K; ++k) {
      p.key = ck::optim_key(s.name, kinds[k]);
      p.dtype = s.stepped.scalar_type();
      p.data = local[i].empty() ? at::zeros({we - wb}, s.stepped.options().requires_grad(false))
                                : local[i][k].narrow(0, wb - s.begin, we - wb);
      plan.pieces.push_back(p);
    }
  }

  // Every rank's random generators (CPU and CUDA), to rank 0.
  const std::vector<ck::RngStates> all_rng = ck::gather_rng_states(
      ranks.many() ? ranks.comm : nullptr, ck::capture(ck::Generators::process_defaults()));

  plan.tmp = ck::temp_path(dir, state.step);
  const std::string& tmp = plan.tmp;
  CheckpointStats stats;
  ranks.agreed("save_checkpoint: prepare", [&] {
    if (ranks.rank == 0) ck::prepare_temp(dir, state.step);
  });
  plan.progress("tmp_created");

  Json files = Json::object();  // rank 0: name -> digest + pieces
  ranks.agreed("save_checkpoint: write", [&] {
    if (!plan.full) {
      stats.bytes += write_sharded(plan, ranks.rank);
    } else {
      Json entry = write_full(plan, ranks, &stats.bytes);
      if (ranks.rank == 0) files.set(ck::kFullFile, std::move(entry));
    }
    if (ranks.rank == 0) {
      // Caller state and every rank's generator: small, written by rank 0.
      std::vector<std::pair<std::string, at::Tensor>> extra;
      for (const auto& [name, t] : state.tensors) extra.emplace_back("training/" + name, t);
      for (int r = 0; r < ranks.world; ++r) {
        ck::append_rng_entries(r, all_rng[static_cast<size_t>(r)], extra);
      }
      const ck::FileDigest d =
          ck::write_safetensors((fs::path(tmp) / ck::kExtraFile).string(), extra);
      stats.bytes += static_cast<int64_t>(d.size);
      files.set(ck::kExtraFile, file_entry(d, Json(Json::Array{})));
    }
  });
  plan.progress("files_written");

  ranks.agreed("save_checkpoint: commit", [&] {
    if (ranks.rank != 0) return;
    if (!plan.full) {
      for (int r = 0; r < ranks.world; ++r) {
        const std::string side = (fs::path(tmp) / ck::sidecar_file(r)).string();
        const Json j = Json::parse(ck::read_small_file(side, ck::kMaxManifestBytes));
        for (const auto& [name, entry] : j.as_object()) files.set(name, entry);
        fs::remove(side);
      }
    }
    Json m = Json::object();
    m.set("format", "dtrain-checkpoint");
    m.set("version", ck::kFormatVersion);
    m.set("step", state.step);
    m.set("form", plan.full ? "full" : "sharded");
    m.set("strategy", strategy.name());
    m.set("sharding", layout.sharding);
    m.set("world_size", ranks.world);
    Json tensors{Json::Array{}};
    for (size_t i = 0; i < T; ++i) {
      const StateSlice& s = layout.slices[i];
      Json t = Json::object();
      t.set("name", s.name);
      t.set("kind", ck::kind_name(s.kind));
      t.set("dtype", safetensors_dtype_name(s.dtype));
      Json::Array shape;
      for (int64_t d : s.shape) shape.emplace_back(d);
      t.set("shape", Json(std::move(shape)));
      t.set("optimizer_step", has_state(i) ? Json(agreed_state[2 * i + 1]) : Json());
      tensors.push_back(std::move(t));
    }
    m.set("tensors", std::move(tensors));
    if (opt.active()) {
      Json o = Json::object();
      o.set("type", opt.type_name());
      Json::Array k, lrs;
      for (const auto& kind : kinds) k.emplace_back(kind);
      for (double lr : opt.learning_rates()) lrs.emplace_back(lr);
      o.set("state", Json(std::move(k)));
      o.set("lr", Json(std::move(lrs)));
      m.set("optimizer", std::move(o));
    } else {
      m.set("optimizer", Json());
    }
    Json training = Json::object();
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

}  // namespace dtrain

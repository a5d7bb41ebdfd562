// save_checkpoint and the steps of a save (save.h): the strategy's StateLayout (which
// flattened elements of which tensor a rank holds) written as pieces (layout.h) into
// safetensors files: in the sharded form each rank its own file, in the full form rank 0
// one file with every tensor whole; then rank 0 writes the manifest and makes the
// checkpoint visible.
#include "checkpoint/save.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "checkpoint/directory.h"
#include "checkpoint/layout.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/progress.h"
#include "checkpoint/rank_state.h"
#include "checkpoint/rng_states.h"
#include "checkpoint/safetensors.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint {
namespace fs = std::filesystem;
namespace {

Json file_entry(const FileDigest& d, Json pieces) {
  Json j = digest_to_json(d);
  j.set("pieces", std::move(pieces));
  return j;
}

// A host copy that shares nothing with `t` (t.cpu() of a CPU tensor would be `t` itself).
at::Tensor host_copy(const at::Tensor& t) {
  return t.to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true);
}

// `buffer` (a previous save's host copy) can take a copy of `t`.
bool fits(const at::Tensor& buffer, const at::Tensor& t) {
  return buffer.defined() && buffer.device().is_cpu() && buffer.is_contiguous() &&
         buffer.scalar_type() == t.scalar_type() && buffer.sizes() == t.sizes();
}

// The manifest, without "files" (rank 0).
Json manifest_of(const SaveJob& job, Strategy& strategy, const StateLayout& layout,
                 const OptimizerAdapter& opt, const std::vector<int64_t>& agreed,
                 const TrainingState& state) {
  Json m = Json::object();
  m.set("format", "dtrain-checkpoint");
  m.set("version", kFormatVersion);
  m.set("step", state.step);
  m.set("form", job.full ? "full" : "sharded");
  m.set("strategy", strategy.name());
  m.set("sharding", layout.sharding);
  m.set("world_size", job.world);
  Json tensors{Json::Array{}};
  for (size_t i = 0; i < layout.slices.size(); ++i) {
    const StateSlice& s = layout.slices[i];
    Json t = Json::object();
    t.set("name", s.name);
    t.set("kind", kind_name(s.kind));
    t.set("dtype", safetensors_dtype_name(s.dtype));
    Json::Array shape;
    for (int64_t d : s.shape) shape.emplace_back(d);
    t.set("shape", Json(std::move(shape)));
    t.set("optimizer_step", agreed[2 * i] != 0 ? Json(agreed[2 * i + 1]) : Json());
    tensors.push_back(std::move(t));
  }
  m.set("tensors", std::move(tensors));
  if (opt.active()) {
    Json o = Json::object();
    o.set("type", opt.type_name());
    Json::Array k, lrs;
    for (const auto& kind : opt.kinds()) k.emplace_back(kind);
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
  return m;
}

// The full form's gather (collective): rank 0 assembles every tensor whole, one at a time,
// on the communicator's device, and hands it to `sink(n, tensor)`; the other ranks send.
template <typename Sink>
void gather_full(const SaveJob& job, const Ranks& ranks, Sink&& sink) {
  const size_t n_items = job.pieces.size();
  std::vector<int64_t> mine;
  for (const Piece& p : job.pieces) {
    mine.push_back(p.wb);
    mine.push_back(p.we);
  }
  const std::vector<int64_t> rg = ranks.many() ? ControlPlane(*ranks.comm).all_gather(mine) : mine;
  auto range_of = [&](int r, size_t n) {
    return std::make_pair(rg[r * 2 * n_items + 2 * n], rg[r * 2 * n_items + 2 * n + 1]);
  };
  if (ranks.rank != 0) {
    for (const Piece& p : job.pieces) {
      at::Tensor t = p.data.contiguous();
      if (t.numel() > 0) ranks.comm->send(t.to(ranks.device()), 0, kTag)->wait();
    }
    return;
  }
  for (size_t n = 0; n < n_items; ++n) {
    const Piece& p = job.pieces[n];
    at::Tensor buf =
        at::empty({numel_of(p.shape)}, at::TensorOptions().dtype(p.dtype).device(ranks.device()));
    // Each element must come from exactly one rank (a strategy bug otherwise).
    std::vector<std::pair<int64_t, int64_t>> got;
    for (int r = 0; r < ranks.world; ++r) {
      const auto [b, e] = range_of(r, n);
      if (e <= b) continue;
      got.emplace_back(b, e);
      if (r == 0) {
        buf.narrow(0, b, e - b).copy_(p.data);
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
          fmt::format("the ranks' slices of '{}' do not cover it exactly", p.key));
    }
    sink(n, buf);
  }
}

// The full form's file: its layout (every tensor whole) and the manifest's pieces.
std::vector<SafetensorsTensor> full_layout(const SaveJob& job, Json* pieces) {
  std::vector<SafetensorsTensor> layout;
  for (const Piece& p : job.pieces) {
    SafetensorsTensor info;
    info.name = p.key;
    info.dtype = p.dtype;
    info.shape = p.shape;
    layout.push_back(info);
    pieces->push_back(
        Json(Json::Array{Json(info.name), Json(int64_t{0}), Json(numel_of(p.shape))}));
  }
  return layout;
}

}  // namespace

std::string error_file(int rank) { return fmt::format("rank{:05d}.error", rank); }

SaveJob plan_save(const std::string& dir, Strategy& strategy, torch::optim::Optimizer* optimizer,
                  const TrainingState& state, const CheckpointOptions& options, bool copy,
                  const std::vector<at::Tensor>& reuse) {
  StateLayout layout = strategy.state_layout();
  const Ranks ranks(layout.comm);
  if (options.keep < 1) throw InvalidArgument(ranks.ctx("save_checkpoint"), "keep must be >= 1");
  if (state.step < 0) throw InvalidArgument(ranks.ctx("save_checkpoint"), "step must be >= 0");
  const OptimizerAdapter opt(optimizer);
  const auto& kinds = opt.kinds();
  const size_t T = layout.slices.size(), K = kinds.size();
  SaveJob job;
  job.dir = dir;
  job.step = state.step;
  job.full = options.format == CheckpointFormat::kFull;
  job.comm = layout.comm;
  job.rank = ranks.rank;
  job.world = ranks.world;
  job.keep = options.keep;
  job.on_progress = detail::CheckpointProgress::get(options);

  // This rank's optimizer state per slice (per kind, 1-D over the slice's range), and the
  // ranks' agreement on which tensors have state and their step counts (a rank whose shard
  // never got a gradient has none).
  std::vector<std::vector<at::Tensor>> local(T);
  std::vector<int64_t> agree(2 * T, 0);
  if (opt.active()) {
    for (size_t i = 0; i < T; ++i) {
      const StateSlice& s = layout.slices[i];
      if (!s.stepped.defined()) continue;
      ParamOptState st = opt.get(s.stepped);
      if (!st.present) continue;
      agree[2 * i] = 1;
      agree[2 * i + 1] = st.step;
      for (const auto& t : st.tensors) {
        local[i].push_back(t.detach().reshape({-1}).narrow(0, s.stepped_offset, s.end - s.begin));
      }
    }
    if (ranks.many()) agree = ControlPlane(*ranks.comm).all_reduce(agree, ReduceOp::kMax);
  }
  // The pieces this rank writes, in one order on every rank: each slice's data, then its
  // optimizer state by kind.
  for (size_t i = 0; i < T; ++i) {
    const StateSlice& s = layout.slices[i];
    const auto [wb, we] = write_range(s);
    Piece p;
    p.key = model_key(s.name);
    p.dtype = s.dtype;
    p.shape = s.shape;
    p.wb = wb;
    p.we = we;
    p.data = s.data.narrow(0, wb - s.begin, we - wb);
    job.pieces.push_back(p);
    if (agree[2 * i] == 0) continue;
    for (size_t k = 0; k < K; ++k) {
      p.key = optim_key(s.name, kinds[k]);
      p.dtype = s.stepped.scalar_type();
      p.data = local[i].empty() ? at::zeros({we - wb}, s.stepped.options().requires_grad(false))
                                : local[i][k].narrow(0, wb - s.begin, we - wb);
      job.pieces.push_back(p);
    }
  }

  // Every rank's random generators (CPU and CUDA), to rank 0.
  const std::vector<RngStates> all_rng = gather_rng_states(ranks.many() ? ranks.comm : nullptr,
                                                           capture(Generators::process_defaults()));
  // Every rank's own state outside the model (a comm hook's), to rank 0.
  const std::vector<NamedTensors> all_rank_state =
      gather_rank_states(ranks.many() ? ranks.comm : nullptr, layout.rank_state);
  if (ranks.rank == 0) {
    // Caller state, every rank's generator and state: written by rank 0.
    for (const auto& [name, t] : state.tensors) {
      job.extra.emplace_back("training/" + name, copy ? host_copy(t.detach()) : t);
    }
    for (int r = 0; r < ranks.world; ++r) {
      append_rng_entries(r, all_rng[static_cast<size_t>(r)], job.extra);
    }
    for (int r = 0; r < ranks.world; ++r) {
      append_rank_state_entries(r, all_rank_state[static_cast<size_t>(r)], job.extra);
    }
    job.manifest = manifest_of(job, strategy, layout, opt, agree, state);
  }

  job.tmp = temp_path(dir, state.step);
  ranks.agreed("save_checkpoint: prepare", [&] {
    if (ranks.rank == 0) prepare_temp(dir, state.step);
  });
  job.progress("tmp_created");

  if (copy) {
    // The copy a background save blocks the step for.
    ranks.agreed("save_checkpoint: copy", [&] {
      if (!job.full) {
        for (size_t n = 0; n < job.pieces.size(); ++n) {
          Piece& p = job.pieces[n];
          if (n < reuse.size() && fits(reuse[n], p.data)) {
            reuse[n].copy_(p.data);
            p.data = reuse[n];
          } else {
            p.data = host_copy(p.data);
          }
        }
        return;
      }
      std::vector<Piece> whole;
      gather_full(job, ranks, [&](size_t n, const at::Tensor& buf) {
        Piece p = job.pieces[n];
        p.wb = 0;
        p.we = buf.numel();
        p.data = buf.device().is_cpu() ? buf : host_copy(buf);  // buf is this gather's own
        whole.push_back(std::move(p));
      });
      job.pieces = std::move(whole);
    });
    job.copied = true;
  }
  return job;
}

void write_rank_files(SaveJob& job) {
  Json sidecar = Json::object();
  if (!job.full) {
    std::vector<SafetensorsTensor> file_layout;
    Json pieces{Json::Array{}};
    std::vector<at::Tensor> data;
    for (const Piece& p : job.pieces) {
      if (p.data.numel() == 0) continue;
      SafetensorsTensor info;
      info.name = p.key;
      info.dtype = p.data.scalar_type();
      info.shape = {p.data.numel()};
      file_layout.push_back(info);
      pieces.push_back(Json(Json::Array{Json(info.name), Json(p.wb), Json(p.we)}));
      data.push_back(p.data);
    }
    if (!data.empty()) {
      SafetensorsWriter w((fs::path(job.tmp) / rank_file(job.rank)).string(), file_layout);
      for (size_t n = 0; n < data.size(); ++n) {
        if (n == data.size() / 2) job.progress("mid_file");
        w.write(data[n]);
      }
      const FileDigest d = SafetensorsAccess::finish(w);
      job.bytes += static_cast<int64_t>(d.size);
      sidecar.set(rank_file(job.rank), file_entry(d, std::move(pieces)));
    }
  }
  // Written under another name and renamed: a sidecar that exists is complete.
  const fs::path side = fs::path(job.tmp) / sidecar_file(job.rank);
  const std::string part = side.string() + ".part";
  write_small_file(part, sidecar.dump());
  std::error_code ec;
  fs::rename(part, side, ec);
  if (ec) throw CheckpointError(fmt::format("{}: cannot rename: {}", part, ec.message()));
}

void write_full_streaming(SaveJob& job, const Ranks& ranks) {
  if (ranks.rank != 0) {
    gather_full(job, ranks, [](size_t, const at::Tensor&) {});
    return;
  }
  Json pieces{Json::Array{}};
  const std::vector<SafetensorsTensor> file_layout = full_layout(job, &pieces);
  SafetensorsWriter w((fs::path(job.tmp) / kFullFile).string(), file_layout);
  gather_full(job, ranks, [&](size_t n, const at::Tensor& buf) {
    if (n == file_layout.size() / 2) job.progress("mid_file");
    w.write(buf);  // the writer copies to host
  });
  const FileDigest d = SafetensorsAccess::finish(w);
  job.bytes += static_cast<int64_t>(d.size);
  job.files.set(kFullFile, file_entry(d, std::move(pieces)));
}

void write_full_copied(SaveJob& job) {
  if (job.rank != 0) return;
  Json pieces{Json::Array{}};
  const std::vector<SafetensorsTensor> file_layout = full_layout(job, &pieces);
  SafetensorsWriter w((fs::path(job.tmp) / kFullFile).string(), file_layout);
  for (size_t n = 0; n < job.pieces.size(); ++n) {
    if (n == job.pieces.size() / 2) job.progress("mid_file");
    w.write(job.pieces[n].data);
  }
  const FileDigest d = SafetensorsAccess::finish(w);
  job.bytes += static_cast<int64_t>(d.size);
  job.files.set(kFullFile, file_entry(d, std::move(pieces)));
}

void write_extra(SaveJob& job) {
  if (job.rank != 0) return;
  const FileDigest d = write_safetensors((fs::path(job.tmp) / kExtraFile).string(), job.extra);
  job.bytes += static_cast<int64_t>(d.size);
  job.files.set(kExtraFile, file_entry(d, Json(Json::Array{})));
}

void commit(SaveJob& job) {
  if (job.rank != 0) return;
  if (!job.full || job.copied) {
    for (int r = 0; r < job.world; ++r) {
      const std::string side = (fs::path(job.tmp) / sidecar_file(r)).string();
      const Json j = Json::parse(read_small_file(side, kMaxManifestBytes));
      for (const auto& [name, entry] : j.as_object()) job.files.set(name, entry);
      fs::remove(side);
    }
  }
  Json m = job.manifest;
  m.set("files", job.files);
  write_manifest(job.tmp, m);
  commit_temp(job.dir, job.step, job.on_progress);
  prune(job.dir, job.keep);
}

}  // namespace dtrain::checkpoint

namespace dtrain {
namespace ck = checkpoint;

std::string latest_checkpoint(const std::string& dir) { return ck::latest_complete(dir); }

CheckpointStats save_checkpoint(const std::string& dir, Strategy& strategy,
                                torch::optim::Optimizer* optimizer, const TrainingState& state,
                                const CheckpointOptions& options) {
  if (options.async) {
    throw InvalidArgument(
        "save_checkpoint: CheckpointOptions::async needs a dtrain::Checkpointer (its wait() "
        "reports the background write's errors)");
  }
  Checkpointer checkpointer(dir, options);
  return checkpointer.save(strategy, optimizer, state);
}

}  // namespace dtrain

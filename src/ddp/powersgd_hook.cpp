#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "ddp/low_rank.h"
#include "dtrain/errors.h"
#include "dtrain/powersgd.h"
#include "dtrain/work.h"

namespace dtrain {

// One bucket's plan (which gradients are compressed, where their factors go) and state.
// Factors are kept transposed (P^T: r x n, Q^T: r x m) so that each factor's rows are
// contiguous for the orthonormalisation.
struct PowerSgdHook::Bucket {
  struct Matrix {
    int64_t offset = 0;    // of the gradient in the bucket
    int64_t n = 0, m = 0;  // the gradient seen as n x m
    int64_t r = 0;
    int64_t p_offset = 0;  // of P^T in the first collective, after the plain part
    int64_t q_offset = 0;  // of Q^T in the second collective (and the saved Q)
  };
  struct Plain {
    int64_t offset = 0, numel = 0;  // in the bucket
  };

  // The layout the plan was made for: bucket length and each gradient's offset and shape.
  int64_t numel = -1;
  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> shapes;

  std::vector<Matrix> matrices;
  std::vector<Plain> plain;
  int64_t plain_numel = 0, p_numel = 0, q_numel = 0;

  at::Tensor error;  // fp32, numel; defined once error feedback started (or was loaded)
  at::Tensor q;      // fp32, q_numel; the warm start's Q^T factors, or loaded
  bool has_state() const { return error.defined() || q.defined(); }
};

namespace {

ErrorContext context(const Communicator& comm) {
  return ErrorContext{comm.rank(), comm.world_size(), "powersgd_hook", -1};
}

}  // namespace

PowerSgdHook::PowerSgdHook(PowerSgdOptions options) : options_(options) {
  auto invalid = [](const std::string& why) {
    throw InvalidArgument(ErrorContext{-1, -1, "powersgd_hook", -1}, why);
  };
  if (options_.rank < 1) invalid(fmt::format("rank must be >= 1, got {}", options_.rank));
  if (options_.start_iter < 0) {
    invalid(fmt::format("start_iter must be >= 0, got {}", options_.start_iter));
  }
  if ((options_.error_feedback || options_.warm_start) && options_.start_iter < 2) {
    invalid(fmt::format(
        "start_iter must be >= 2 with error_feedback or warm_start (got {}): DataParallel "
        "rebuilds its buckets after the first step, and the per-bucket state must be made "
        "for the final buckets",
        options_.start_iter));
  }
  if (!(options_.min_compression_rate >= 0)) {
    invalid(
        fmt::format("min_compression_rate must be >= 0, got {}", options_.min_compression_rate));
  }
}

PowerSgdHook::~PowerSgdHook() = default;

PowerSgdHook::Bucket& PowerSgdHook::bucket_state(const Communicator& comm, const GradBucket& b) {
  auto& slot = buckets_[b.index];
  if (!slot) slot = std::make_unique<Bucket>();
  Bucket& s = *slot;
  auto same_layout = [&] {
    if (s.numel != b.buffer.numel() || s.offsets != b.offsets ||
        s.shapes.size() != b.parameters.size()) {
      return false;
    }
    for (size_t j = 0; j < b.parameters.size(); ++j) {
      if (s.shapes[j] != b.parameters[j].sizes().vec()) return false;
    }
    return true;
  };
  if (s.numel >= 0 && same_layout()) return s;
  if (b.offsets.size() != b.parameters.size()) {
    throw InvalidArgument(context(comm),
                          fmt::format("bucket {} has {} parameters but {} offsets", b.index,
                                      b.parameters.size(), b.offsets.size()));
  }
  // A new layout: make the plan.
  Bucket plan;
  plan.numel = b.buffer.numel();
  plan.offsets = b.offsets;
  for (size_t j = 0; j < b.parameters.size(); ++j) {
    const at::Tensor& p = b.parameters[j];
    plan.shapes.push_back(p.sizes().vec());
    const int64_t numel = p.numel();
    if (p.dim() >= 2 && numel > 0) {
      const int64_t n = p.size(0), m = numel / n;
      const int64_t r = std::min<int64_t>({options_.rank, n, m});
      // PyTorch's rule: compress when the factors are smaller by more than the rate.
      if (static_cast<double>(n + m) * static_cast<double>(r) * options_.min_compression_rate <
          static_cast<double>(n) * static_cast<double>(m)) {
        plan.matrices.push_back({b.offsets[j], n, m, r, plan.p_numel, plan.q_numel});
        plan.p_numel += r * n;
        plan.q_numel += r * m;
        continue;
      }
    }
    plan.plain.push_back({b.offsets[j], numel});
    plan.plain_numel += numel;
  }
  if (s.numel < 0 && s.has_state()) {
    // State loaded from a checkpoint: it must fit the plan.
    if ((s.error.defined() && s.error.numel() != plan.numel) ||
        (s.q.defined() && s.q.numel() != plan.q_numel)) {
      throw InvalidArgument(
          context(comm),
          fmt::format("the loaded state of bucket {} (error {} elements, Q {}) does not fit "
                      "the bucket ({} elements, Q {}): saved under another bucket layout",
                      b.index, s.error.defined() ? s.error.numel() : 0,
                      s.q.defined() ? s.q.numel() : 0, plan.numel, plan.q_numel));
    }
  } else if (s.has_state()) {
    throw InvalidArgument(
        context(comm),
        fmt::format("bucket {} changed its layout ({} to {} elements, {} to {} parameters) "
                    "after PowerSGD made state for it",
                    b.index, s.numel, plan.numel, s.shapes.size(), plan.shapes.size()));
  }
  plan.error = s.error;
  plan.q = s.q;
  s = std::move(plan);
  return s;
}

WorkPtr PowerSgdHook::run(Communicator& comm, GradBucket& b) {
  const int64_t step = iteration_;
  if (b.is_last) ++iteration_;
  if (!at::isFloatingType(b.buffer.scalar_type())) {
    throw InvalidArgument(context(comm),
                          fmt::format("bucket {} is not floating point ({})", b.index,
                                      c10::toString(b.buffer.scalar_type())));
  }
  if (step < options_.start_iter) return comm.all_reduce(b.buffer, ReduceOp::kAvg);

  Bucket& s = bucket_state(comm, b);
  const auto f32 = b.buffer.options().dtype(at::kFloat);
  // Everything is computed in fp32; a bucket of another dtype is copied.
  at::Tensor g = b.buffer.scalar_type() == at::kFloat ? b.buffer : b.buffer.to(at::kFloat);
  if (options_.error_feedback) {
    if (s.error.defined()) {
      if (s.error.device() != g.device()) s.error = s.error.to(g.device());
      g.add_(s.error);
    } else {
      s.error = at::zeros({s.numel}, f32);
    }
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      detail::powersgd_q_seed(options_.seed, step, b.index));
  at::Tensor fresh =
      at::randn({s.q_numel}, gen, at::TensorOptions().dtype(at::kFloat)).to(g.device());
  // Q for this step: the warm start's, or the fresh draw (kept only with warm start).
  if (!options_.warm_start || !s.q.defined()) {
    s.q = fresh;
  } else {
    if (s.q.device() != g.device()) s.q = s.q.to(g.device());
    // A row of Q that became zero (its matrix's gradient was zero, e.g. a layer unused in a
    // step) would keep P, hence that matrix's update, zero from then on: it starts afresh.
    for (const auto& x : s.matrices) {
      at::Tensor qt = s.q.narrow(0, x.q_offset, x.r * x.m).view({x.r, x.m});
      at::Tensor restart = fresh.narrow(0, x.q_offset, x.r * x.m).view({x.r, x.m});
      qt.copy_(at::where(qt.abs().amax(1, true) == 0, restart, qt));
    }
  }
  auto matrix = [&g](const Bucket::Matrix& x) {
    return g.narrow(0, x.offset, x.n * x.m).view({x.n, x.m});
  };

  // First collective: the plain gradients and every P = M Q (as P^T = Q^T M^T), summed.
  at::Tensor first = at::empty({s.plain_numel + s.p_numel}, f32);
  int64_t at_plain = 0;
  for (const auto& x : s.plain) {
    first.narrow(0, at_plain, x.numel).copy_(g.narrow(0, x.offset, x.numel));
    at_plain += x.numel;
  }
  for (const auto& x : s.matrices) {
    at::Tensor pt = first.narrow(0, s.plain_numel + x.p_offset, x.r * x.n).view({x.r, x.n});
    at::Tensor qt = s.q.narrow(0, x.q_offset, x.r * x.m).view({x.r, x.m});
    at::mm_out(pt, qt, matrix(x).t());
  }
  auto sent = comm.all_reduce(first, ReduceOp::kSum);

  // The rest runs when the bucket is waited for: DataParallel waits for buckets in index
  // order on every rank, so the second collectives line up across ranks.
  Communicator* c = &comm;
  const double world = comm.world_size();
  at::Tensor buffer = b.buffer;
  Bucket* state = &s;  // buckets_ owns it for the hook's life; only this bucket touches it
  const bool error_feedback = options_.error_feedback;
  const bool warm_start = options_.warm_start;
  return then(sent, [c, state, g, buffer, first, world, error_feedback, warm_start]() mutable {
    Bucket& s = *state;
    auto matrix = [&g](const Bucket::Matrix& x) {
      return g.narrow(0, x.offset, x.n * x.m).view({x.n, x.m});
    };
    auto pt_of = [&](const Bucket::Matrix& x) {
      return first.narrow(0, s.plain_numel + x.p_offset, x.r * x.n).view({x.r, x.n});
    };
    at::Tensor q = at::empty({s.q_numel}, first.options());
    auto qt_of = [&](const Bucket::Matrix& x) {
      return q.narrow(0, x.q_offset, x.r * x.m).view({x.r, x.m});
    };
    for (const auto& x : s.matrices) {
      at::Tensor pt = pt_of(x);
      detail::orthonormalize_rows(pt);
      at::Tensor qt = qt_of(x);
      at::mm_out(qt, pt, matrix(x));  // Q^T = P^T M: this rank's Q
    }
    if (error_feedback) {
      // What this rank's input loses: M - P P^T M with its own Q (the paper's e = M - P Q^T).
      // The plain gradients are exact.
      at::Tensor e = s.error;
      e.zero_();
      for (const auto& x : s.matrices) {
        at::Tensor ex = e.narrow(0, x.offset, x.n * x.m).view({x.n, x.m});
        at::mm_out(ex, pt_of(x).t(), qt_of(x));
        ex.neg_().add_(matrix(x));
      }
    }
    // Every rank has the same plan, so all skip an empty Q together.
    if (s.q_numel > 0) c->all_reduce(q, ReduceOp::kSum)->wait();
    // The average: P (sum of Q)^T / world for matrices, the plain sums / world.
    for (const auto& x : s.matrices) {
      at::Tensor m = matrix(x);
      at::mm_out(m, pt_of(x).t(), qt_of(x));
    }
    int64_t at_plain = 0;
    for (const auto& x : s.plain) {
      g.narrow(0, x.offset, x.numel).copy_(first.narrow(0, at_plain, x.numel));
      at_plain += x.numel;
    }
    g.div_(world);
    // The warm start of the next step; without it there is no Q to keep (it is drawn anew).
    s.q = warm_start ? q : at::Tensor();
    if (!g.is_same(buffer)) buffer.copy_(g);
  });
}

std::map<std::string, at::Tensor> PowerSgdHook::state() const {
  std::map<std::string, at::Tensor> out;
  out["iteration"] = at::full({1}, iteration_, at::TensorOptions().dtype(at::kLong));
  for (const auto& [index, s] : buckets_) {
    const std::string prefix = fmt::format("bucket.{}.", index);
    if (s->error.defined()) out[prefix + "error"] = s->error.to(at::kCPU).clone();
    if (s->q.defined() && options_.warm_start) out[prefix + "q"] = s->q.to(at::kCPU).clone();
  }
  return out;
}

void PowerSgdHook::load_state(const std::map<std::string, at::Tensor>& state) {
  auto invalid = [](const std::string& why) {
    throw InvalidArgument(ErrorContext{-1, -1, "PowerSgdHook::load_state", -1}, why);
  };
  auto it = state.find("iteration");
  if (it == state.end() || it->second.numel() != 1 || it->second.scalar_type() != at::kLong) {
    invalid("no \"iteration\" entry (an int64 tensor of one element)");
  }
  std::map<int, std::unique_ptr<Bucket>> loaded;
  for (const auto& [name, t] : state) {
    if (name == "iteration") continue;
    int index = -1;
    char what[8] = {0};
    int consumed = 0;
    if (std::sscanf(name.c_str(), "bucket.%d.%7[a-z]%n", &index, what, &consumed) != 2 ||
        consumed != static_cast<int>(name.size()) || index < 0 ||
        (std::string(what) != "error" && std::string(what) != "q")) {
      invalid("unknown entry \"" + name + "\"");
    }
    if (t.scalar_type() != at::kFloat || t.dim() != 1) {
      invalid("entry \"" + name + "\" must be a 1-D fp32 tensor");
    }
    auto& slot = loaded[index];
    if (!slot) slot = std::make_unique<Bucket>();
    (std::string(what) == "error" ? slot->error : slot->q) = t.contiguous().clone();
  }
  iteration_ = it->second.item<int64_t>();
  buckets_ = std::move(loaded);
}

std::shared_ptr<PowerSgdHook> powersgd_hook(PowerSgdOptions options) {
  return std::make_shared<PowerSgdHook>(options);
}

}  // namespace dtrain

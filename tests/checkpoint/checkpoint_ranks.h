// Ranks for the checkpoint tests: a strategy per rank thread (single, DDP, FSDP with any
// sharding) over the test transformer with a buffer and a frozen parameter, AdamW, the
// global batches, and the full logical state built with collectives only (independent of
// the checkpoint files).
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "compat/torch_compat.h"
#include "dtrain/data_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/rendezvous.h"
#include "dtrain/single_device.h"
#include "strategy/training.h"
#include "support/ranks.h"

namespace dtrain::testing {

constexpr int64_t kGlobalRows = 12;  // divisible by 1, 2, 3 and 4 ranks

struct RankSetup {
  std::string name;
  std::string strategy;  // single | ddp | fsdp
  int world = 1;
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  int group = 0;     // hybrid shard group size
  int64_t dim = 16;  // the test transformer's width
};

inline std::vector<Batch> global_batches() {
  torch::manual_seed(99);
  std::vector<Batch> out;
  for (int s = 0; s < 3; ++s) {
    out.push_back({at::randint(0, 50, {kGlobalRows, 8}), at::randint(0, 50, {kGlobalRows, 8})});
  }
  return out;
}

// The test transformer plus a buffer and a frozen parameter.
inline std::shared_ptr<torch::nn::Module> make_ckpt_model(int64_t dim = 16) {
  torch::manual_seed(7);
  auto m = TinyTransformer(/*vocab=*/50, /*ctx=*/8, dim, /*heads=*/2, /*layers=*/2).ptr();
  m->register_buffer("counter", at::arange(5, at::kFloat) * 3);
  m->register_parameter("frozen", at::randn({3, 2}), /*requires_grad=*/false);
  return m;
}

struct Rank {
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<Strategy> strategy;
  std::unique_ptr<torch::optim::Optimizer> opt;
  int rank = 0, world = 1;

  void step(const Batch& b) {
    const int64_t rows = kGlobalRows / world;
    at::Tensor x = b.x.narrow(0, rank * rows, rows), y = b.y.narrow(0, rank * rows, rows);
    for (auto& p : strategy->parameters()) p.mutable_grad().reset();
    at::Tensor l =
        strategy->forward([&] { return loss_of(Model::kTransformer, *module, x, y, false); });
    strategy->backward(l);
    opt->step();
  }
};

// Runs fn on setup.world rank threads, each with a strategy built per `setup`.
inline void run_setup(const RankSetup& setup, const std::function<void(Rank&)>& fn) {
  auto store = make_memory_store();
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < setup.world; ++r) {
    threads.emplace_back([&, r] {
      try {
        at::set_num_threads(1);
        Rank rk;
        rk.rank = r;
        rk.world = setup.world;
        rk.module = make_ckpt_model(setup.dim);
        if (setup.strategy == "single") {
          rk.strategy = std::make_shared<SingleDevice>(rk.module);
        } else {
          auto comm = make_communicator(store, r, setup.world);
          if (setup.strategy == "ddp") {
            rk.strategy = std::make_shared<DataParallel>(rk.module, comm);
          } else {
            FsdpOptions o;
            o.sharding = setup.sharding;
            o.wrap_policy = wrap_modules_named("BlockImpl");
            if (setup.group > 0) {
              auto g = make_hybrid_groups(store, r, setup.world, setup.group);
              o.shard_group = g.shard_group;
              o.replicate_group = g.replicate_group;
            }
            rk.strategy = std::make_shared<FullyShardedDataParallel>(rk.module, comm, o);
          }
        }
        rk.opt = std::make_unique<torch::optim::AdamW>(
            rk.strategy->parameters(),
            torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-4));
        fn(rk);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// The full logical state (every tensor, AdamW moments, step counts) on every rank, built
// from state_layout() with collectives only (independent of the checkpoint files).
inline std::map<std::string, at::Tensor> logical_state(Rank& rk) {
  StateLayout layout = rk.strategy->state_layout();
  std::map<std::string, at::Tensor> out;
  auto combine = [&](at::Tensor t, ReduceOp op) {
    if (layout.comm && layout.comm->world_size() > 1) layout.comm->all_reduce(t, op)->wait();
    return t;
  };
  auto& state = rk.opt->state();
  for (const auto& s : layout.slices) {
    const int64_t n =
        std::accumulate(s.shape.begin(), s.shape.end(), int64_t{1}, std::multiplies<int64_t>());
    at::Tensor d = at::zeros({n}, at::kFloat), m = at::zeros({n}), v = at::zeros({n});
    at::Tensor step = at::zeros({1}, at::kLong);
    if (s.replica == 0) {
      d.narrow(0, s.begin, s.end - s.begin).copy_(s.data);
      if (s.stepped.defined()) {
        auto it = state.find(compat::optimizer_state_key(state, s.stepped));
        if (it != state.end()) {
          auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
          m.narrow(0, s.begin, s.end - s.begin)
              .copy_(st.exp_avg().reshape({-1}).narrow(0, s.stepped_offset, s.end - s.begin));
          v.narrow(0, s.begin, s.end - s.begin)
              .copy_(st.exp_avg_sq().reshape({-1}).narrow(0, s.stepped_offset, s.end - s.begin));
          step.fill_(st.step());
        }
      }
    }
    out[s.name] = combine(d, ReduceOp::kSum);
    out["exp_avg/" + s.name] = combine(m, ReduceOp::kSum);
    out["exp_avg_sq/" + s.name] = combine(v, ReduceOp::kSum);
    out["step/" + s.name] = combine(step, ReduceOp::kMax);
  }
  return out;
}

}  // namespace dtrain::testing

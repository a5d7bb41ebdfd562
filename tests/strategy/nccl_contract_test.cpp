// Every strategy through a communicator held to NCCL's contract (support/nccl_contract.h):
// DDP (every comm hook, find_unused_parameters, bucket rebuild), FSDP (every sharding
// strategy, accumulation, bf16 mixed precision), checkpoints (both formats, loaded at another
// world size), GradScaler and a trainer-like step (gradient norm, metrics), at 2 and 4
// ranks, each matching single-device training on the CPU. Everything that is not a gradient
// or a parameter must go through the control plane (comm/control_plane.h), on the
// communicator's device, or the contract refuses it.
//
// The contract device is the fake accelerator (support/fake_device.h): its memory cannot be
// read by host code (a host memcpy on it crashes), and the contract refuses CPU tensors on
// it, so a control exchange left on the CPU or a host copy of device memory fails here as it
// would with NCCL on a GPU.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <torch/optim/adamw.h>
#include <cstdio>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <numeric>

#include "comm/control_plane.h"
#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/grad_scaler.h"
#include "dtrain/single_device.h"
#include "strategy/fsdp_ranks.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/fake_device.h"
#include "support/nccl_contract.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;

// The fake accelerator (support/fake_device.h): host code that touches its memory crashes.
c10::Device contract_device() { return fake_device(); }

// The contract communicator of every rank, and hybrid groups of `group_size` (none when 0)
// held to the same contract.
struct ContractRank {
  CommunicatorPtr comm;
  CommunicatorPtr shard_group, replicate_group;
};

// One rank of run_contract.
void run_contract_rank(int r, int world, int group_size, const std::shared_ptr<Store>& store,
                       c10::Device device, const std::function<void(ContractRank&)>& fn) {
  CommunicatorOptions o;
  o.timeout = std::chrono::seconds(30);  // a refused rank leaves its peers waiting this long
  at::set_num_threads(1);
  ContractRank rk;
  rk.comm = make_nccl_contract_communicator(store, r, world, device, o);
  if (group_size > 0) {
    o.device = device;
    HybridGroups g = make_hybrid_groups(store, r, world, group_size, o);
    rk.shard_group = std::make_shared<NcclContractCommunicator>(g.shard_group);
    rk.replicate_group = std::make_shared<NcclContractCommunicator>(g.replicate_group);
  }
  try {
    fn(rk);
  } catch (const std::exception& e) {
    // The first failure is rethrown, often a peer's consequence of this one: say each.
    fprintf(stderr, "rank %d failed: %s\n", r, e.what());
    throw;
  }
}

constexpr const char* kRankEnv = "DTRAIN_CONTRACT_RANK";
constexpr const char* kPortEnv = "DTRAIN_CONTRACT_PORT";

// Runs fn on `world` ranks, each with a contract communicator for `device` (and hybrid
// groups of `group_size`, none when 0). As threads of this process, or with `processes` as
// copies of this test binary running this test, one rank each: LibTorch's autograd engine
// runs the backward of a non-CPU device on one thread per device and process, so thread
// ranks would share it, and FSDP's backward hooks, which wait for collectives of their
// rank, would wait for each other on it (a real job has a process per rank). A test that
// uses `processes` must call run_contract once: the copies run its whole body.
void run_contract(int world, int group_size, const std::function<void(ContractRank&)>& fn,
                  c10::Device device = contract_device(), bool processes = false) {
  if (const char* rank = std::getenv(kRankEnv)) {  // a copy: this process is one rank
    const int r = std::atoi(rank);
    TcpStoreOptions so;
    so.port = static_cast<uint16_t>(std::atoi(std::getenv(kPortEnv)));
    so.is_server = r == 0;
    run_contract_rank(r, world, group_size, make_tcp_store(so), device, fn);
    return;
  }
  if (!processes) {
    auto store = make_memory_store();
    run_threads(world, [&](int r) { run_contract_rank(r, world, group_size, store, device, fn); });
    return;
  }
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string filter =
      fmt::format("--gtest_filter={}.{}", info->test_suite_name(), info->name());
  const int port = free_port();
  std::vector<Process> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(spawn_process({self, filter}, {{kRankEnv, std::to_string(r)},
                                                   {kPortEnv, std::to_string(port)},
                                                   {"OMP_NUM_THREADS", "1"}}));
  }
  std::string failures;
  for (int r = 0; r < world; ++r) {
    const ProcessResult res = wait_process(ranks[r], 300);
    if (res.exit_code != 0) {
      failures +=
          fmt::format("rank {} (exit {}, signal {}):\n{}\n", r, res.exit_code, res.signal,
                      res.output.substr(res.output.size() > 3000 ? res.output.size() - 3000 : 0));
    }
  }
  DTRAIN_CHECK(failures.empty(), "ranks failed:\n{}", failures);
}

// training.h's loop with the batch on `device`.
void train_on(const Case& c, Strategy& strategy, torch::nn::Module& module,
              const std::vector<Batch>& data, int64_t row0, int64_t rows, Strategy* accumulating,
              c10::Device device) {
  std::vector<Batch> moved;
  for (const auto& b : data) {
    moved.push_back({b.x.narrow(0, row0, rows).to(device), b.y.narrow(0, row0, rows).to(device)});
  }
  train(c, strategy, module, moved, 0, rows, accumulating);
}

void expect_parameters_match(const torch::nn::Module& ref, const torch::nn::Module& got, int rank,
                             double rtol, double atol) {
  auto a = ref.named_parameters();
  auto b = got.named_parameters();
  DTRAIN_CHECK(a.size() == b.size(), "parameter count");
  for (const auto& item : a) {
    const at::Tensor have = b[item.key()].to(at::kCPU);
    const at::Tensor& want = item.value();
    DTRAIN_CHECK(at::allclose(have, want, rtol, atol),
                 "rank {} parameter {} differs from single-device training: max |diff| {}", rank,
                 item.key(), (have - want).abs().max().item<double>());
  }
}

// ---- the contract transport itself ----

void expect_contract_refusals(c10::Device device) {
  run_contract(
      2, 0,
      [&](ContractRank& rk) {
        Communicator& comm = *rk.comm;
        DTRAIN_CHECK(comm.device() == device, "device() {}", comm.device().str());
        auto on = at::TensorOptions().device(device);
        auto refused = [&](const std::function<void()>& call, const std::string& needle) {
          try {
            call();
          } catch (const InvalidArgument& e) {
            const std::string what = e.what();
            DTRAIN_CHECK(what.find("NCCL contract") != std::string::npos &&
                             what.find(needle) != std::string::npos,
                         "message '{}' lacks '{}'", what, needle);
            return;
          }
          throw std::runtime_error("not refused: " + needle);
        };
        refused([&] { comm.all_reduce(at::ones({4}, on.dtype(at::kBool)), ReduceOp::kMax); },
                "all_reduce]: NCCL contract: tensor: dtype Bool is not an NCCL dtype");
        refused(
            [&] {
              comm.all_reduce(at::ones({4, 4}, on).t(), ReduceOp::kSum);
            },
            "not contiguous");
        // Host memory labelled as the device's (what from_blob of a host vector gives).
        std::vector<int64_t> host = {1, 2, 3};
        refused(
            [&] {
              comm.broadcast(at::for_blob(host.data(), {3})
                                 .options(on.dtype(at::kLong))
                                 .target_device(device)
                                 .make_tensor(),
                             0);
            },
            "from_blob");
        refused(
            [&] {
              comm.all_gather(at::empty({4}, on), at::ones({2}, on.dtype(at::kComplexFloat)));
            },
            "all_gather]: NCCL contract: input: dtype ComplexFloat");
        if (!device.is_cpu()) {
          refused([&] { comm.all_reduce(at::ones({4}), ReduceOp::kSum); }, "tensor on cpu");
        }
        // What obeys the contract goes through, and stays on the device.
        at::Tensor t = at::full({3}, comm.rank() + 1.0, on);
        comm.all_reduce(t, ReduceOp::kSum)->wait();
        DTRAIN_CHECK(t.device() == device, "result moved to {}", t.device().str());
        DTRAIN_CHECK(at::equal(t.to(at::kCPU), at::full({3}, 3.0)), "sum {}",
                     t.to(at::kCPU).sum().item<double>());
      },
      device);
}

TEST(NcclContract, RefusesWhatNcclRefusesNamingTheCall) {
  expect_contract_refusals(contract_device());
}

// Configured for the CPU, the contract still refuses what NCCL would (wrapped host memory
// included): the transport's own checks do not depend on the fake device.
TEST(NcclContract, RefusesWhatNcclRefusesOnTheCpuToo) {
  expect_contract_refusals(c10::Device(c10::kCPU));
}

TEST(NcclContract, ControlPlaneExchangesGoOnTheCommunicatorsDevice) {
  run_contract(4, 0, [&](ContractRank& rk) {
    ControlPlane control(*rk.comm);
    const int r = control.rank();
    auto gathered = control.all_gather(std::vector<int64_t>{r, 10 * r});
    DTRAIN_CHECK(gathered == (std::vector<int64_t>{0, 0, 1, 10, 2, 20, 3, 30}), "all_gather");
    DTRAIN_CHECK(control.all_reduce_value(1.5 * r, ReduceOp::kSum) == 9.0, "sum");
    auto flags = control.all_reduce(std::vector<uint8_t>{uint8_t(r == 2), 0}, ReduceOp::kMax);
    DTRAIN_CHECK(flags == (std::vector<uint8_t>{1, 0}), "flags");
    auto b = control.broadcast(std::vector<int64_t>{r, r, r}, 3);
    DTRAIN_CHECK(b == (std::vector<int64_t>{3, 3, 3}), "broadcast");
    auto bytes = control.all_gather_bytes(std::string(static_cast<size_t>(r), 'x'));
    for (int q = 0; q < 4; ++q) DTRAIN_CHECK(bytes[q] == std::string(q, 'x'), "bytes of {}", q);
  });
}

// ---- DDP ----

class ContractDataParallel : public ::testing::TestWithParam<std::tuple<int, Case>> {};

TEST_P(ContractDataParallel, MatchesSingleDeviceOnTheCpu) {
  const int world = std::get<0>(GetParam());
  const Case c = std::get<1>(GetParam());
  at::set_num_threads(1);
  const auto data = make_data(c.model, world);
  auto ref = single_device_reference(c, data, world);
  auto modules = rank_models(c.model, world, contract_device());
  run_contract(world, 0, [&](ContractRank& rk) {
    const int r = rk.comm->rank();
    const DataParallelOptions o = ddp_options(c);
    DataParallel ddp(modules[r], rk.comm, o);
    train_on(c, ddp, *modules[r], data, r * kLocalBatch, kLocalBatch, &ddp, contract_device());
    expect_parameters_match(*ref, *modules[r], r, c.rtol, c.atol);
  });
}

std::vector<Case> ddp_cases() {
  auto make = [](std::string name, const std::function<void(Case&)>& set) {
    Case c;
    c.name = std::move(name);
    set(c);
    return c;
  };
  return {
      // Tiny buckets: several buckets, rebuilt from the first iteration's ready order.
      make("allreduce_bucket_rebuild",
           [](Case& c) {
             c.model = Model::kTransformer;
             c.bucket_mb = 0.004;
             c.first_bucket_mb = 0.001;
           }),
      make("find_unused_parameters",
           [](Case& c) {
             c.skip_extra = true;
             c.find_unused = true;
             c.set_to_none = true;
           }),
      make("no_sync_accumulation", [](Case& c) { c.accumulate = true; }),
      make("parameter_server", [](Case& c) { c.hook = [] { return parameter_server_hook(0); }; }),
      make("fp16_compress",
           [](Case& c) {
             c.hook = fp16_compress_hook;
             c.rtol = 1e-2;
             c.atol = 2e-3;
           }),
      make("bf16_compress",
           [](Case& c) {
             c.hook = bf16_compress_hook;
             c.rtol = 5e-2;
             c.atol = 1e-2;
           }),
      // The trainer's clip_grad_norm: a global norm through the control plane.
      make("clip_grad_norm", [](Case& c) { c.clip = 0.05; }),
  };
}

INSTANTIATE_TEST_SUITE_P(Ranks, ContractDataParallel,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::ValuesIn(ddp_cases())),
                         [](const auto& info) {
                           return std::get<1>(info.param).name + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

// ---- FSDP ----

struct ContractFsdpCase {
  std::string name;
  ShardingStrategy sharding = ShardingStrategy::kFullShard;
  bool accumulate = false;
  c10::optional<c10::ScalarType> param_dtype;
  double clip = 0;
  double rtol = 1e-5, atol = 1e-6;
};
void PrintTo(const ContractFsdpCase& c, std::ostream* os) { *os << c.name; }

class ContractFsdp : public ::testing::TestWithParam<std::tuple<int, ContractFsdpCase>> {};

TEST_P(ContractFsdp, MatchesSingleDeviceOnTheCpu) {
  const int world = std::get<0>(GetParam());
  const ContractFsdpCase fc = std::get<1>(GetParam());
  at::set_num_threads(1);
  Case c;
  c.model = Model::kTransformer;
  c.accumulate = fc.accumulate;
  c.clip = fc.clip;
  const auto data = make_data(c.model, world);
  auto ref = single_device_reference(c, data, world);
  auto modules = rank_models(c.model, world, contract_device());
  const bool hybrid = fc.sharding == ShardingStrategy::kHybridShard;
  run_contract(
      world, hybrid ? world / 2 : 0,
      [&](ContractRank& rk) {
        const int r = rk.comm->rank();
        FsdpOptions o;
        o.sharding = fc.sharding;
        o.wrap_policy = blocks_and_nested_up();
        o.mixed_precision.param_dtype = fc.param_dtype;
        o.shard_group = rk.shard_group;
        o.replicate_group = rk.replicate_group;
        FullyShardedDataParallel fsdp(modules[r], rk.comm, o);
        train_on(c, fsdp, *modules[r], data, r * kLocalBatch, kLocalBatch, &fsdp,
                 contract_device());
        auto state = fsdp.full_state_dict();
        for (auto& [name, t] : state) t = t.to(at::kCPU);
        if (r == 0) expect_state_matches(state, *ref, fc.rtol, fc.atol);
      },
      contract_device(), /*processes=*/true);
}

std::vector<ContractFsdpCase> fsdp_cases() {
  auto make = [](std::string name, const std::function<void(ContractFsdpCase&)>& set) {
    ContractFsdpCase c;
    c.name = std::move(name);
    set(c);
    return c;
  };
  return {
      make("full_shard", [](ContractFsdpCase&) {}),
      make("shard_grad_op",
           [](ContractFsdpCase& c) { c.sharding = ShardingStrategy::kShardGradOp; }),
      make("no_shard", [](ContractFsdpCase& c) { c.sharding = ShardingStrategy::kNoShard; }),
      make("hybrid_shard",
           [](ContractFsdpCase& c) { c.sharding = ShardingStrategy::kHybridShard; }),
      make("full_shard_accumulation", [](ContractFsdpCase& c) { c.accumulate = true; }),
      make("no_shard_accumulation",
           [](ContractFsdpCase& c) {
             c.sharding = ShardingStrategy::kNoShard;
             c.accumulate = true;
           }),
      make("full_shard_clip_grad_norm", [](ContractFsdpCase& c) { c.clip = 0.05; }),
      // bf16 keeps 8 significant bits: forward and gradients round at ~4e-3 relative.
      make("full_shard_bf16",
           [](ContractFsdpCase& c) {
             c.param_dtype = at::kBFloat16;
             c.rtol = 5e-2;
             c.atol = 2e-2;
           }),
      make("no_shard_bf16",
           [](ContractFsdpCase& c) {
             c.sharding = ShardingStrategy::kNoShard;
             c.param_dtype = at::kBFloat16;
             c.rtol = 5e-2;
             c.atol = 2e-2;
           }),
  };
}

INSTANTIATE_TEST_SUITE_P(Ranks, ContractFsdp,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::ValuesIn(fsdp_cases())),
                         [](const auto& info) {
                           return std::get<1>(info.param).name + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

// ---- CPU offload ----

// FsdpOptions::cpu_offload with the module on the device: the shards the optimizer steps and
// their gradients are host tensors, the module's (gathered) parameters stay on the device,
// every collective still sees only device tensors (the contract refuses others), and AdamW
// with gradient clipping ends bitwise where the same run without offload ends.
void cpu_offload_matches_no_offload(int world, ShardingStrategy sharding,
                                    c10::optional<c10::ScalarType> param_dtype,
                                    bool use_orig_params) {
  at::set_num_threads(1);
  Case c;
  c.model = Model::kTransformer;
  c.opt = Opt::kAdamW;
  c.clip = 0.05;
  const auto data = make_data(c.model, world);
  run_contract(
      world, 0,
      [&](ContractRank& rk) {
        const int r = rk.comm->rank();
        std::vector<std::pair<std::string, at::Tensor>> result[2];
        for (const bool offload : {false, true}) {
          auto m = make_model(c.model, 7);
          m->to(contract_device());
          FsdpOptions o;
          o.sharding = sharding;
          o.wrap_policy = blocks_and_nested_up();
          o.mixed_precision.param_dtype = param_dtype;
          o.use_orig_params = use_orig_params;
          o.cpu_offload = offload;
          FullyShardedDataParallel fsdp(m, rk.comm, o);
          const c10::Device shard_device = offload ? c10::Device(c10::kCPU) : contract_device();
          train_on(c, fsdp, *m, data, r * kLocalBatch, kLocalBatch, &fsdp, contract_device());
          for (const auto& p : fsdp.parameters()) {
            DTRAIN_CHECK(p.device() == shard_device, "rank {}: a shard on {} (offload {})", r,
                         p.device().str(), offload);
            DTRAIN_CHECK(!p.grad().defined() || p.grad().device() == shard_device,
                         "rank {}: a shard's gradient on {} (offload {})", r,
                         p.grad().device().str(), offload);
          }
          for (const auto& p : m->parameters()) {
            DTRAIN_CHECK(p.device() == contract_device(), "rank {}: a module parameter on {}", r,
                         p.device().str());
          }
          result[offload ? 1 : 0] = fsdp.full_state_dict();
        }
        if (r != 0) return;
        DTRAIN_CHECK(result[0].size() == result[1].size() && !result[0].empty(), "state sizes");
        for (size_t i = 0; i < result[0].size(); ++i) {
          const at::Tensor want = result[0][i].second.to(at::kCPU);
          const at::Tensor got = result[1][i].second.to(at::kCPU);
          DTRAIN_CHECK(at::equal(want, got), "{} differs with cpu_offload: max |diff| {}",
                       result[0][i].first, (got - want).abs().max().item<double>());
        }
      },
      contract_device(), /*processes=*/true);
}

TEST(ContractCpuOffload, FullShardWorld2MatchesNoOffloadBitwise) {
  cpu_offload_matches_no_offload(2, ShardingStrategy::kFullShard, c10::nullopt, false);
}
TEST(ContractCpuOffload, ShardGradOpWorld4ParamViewsMatchesNoOffloadBitwise) {
  cpu_offload_matches_no_offload(4, ShardingStrategy::kShardGradOp, c10::nullopt, true);
}
TEST(ContractCpuOffload, NoShardWorld2Bf16MatchesNoOffloadBitwise) {
  cpu_offload_matches_no_offload(2, ShardingStrategy::kNoShard, at::kBFloat16, true);
}
TEST(ContractCpuOffload, OneRankMatchesNoOffloadBitwise) {
  // One rank: without offload the shard is the module's memory; with it, a host copy.
  cpu_offload_matches_no_offload(1, ShardingStrategy::kFullShard, c10::nullopt, true);
}

// ---- FSDP's copy of the shard into the unit's buffer (no host memcpy on device memory) ----

// With one rank (no shard group) FSDP copies each unit's fp32 shard into its compute-dtype
// buffer instead of all-gathering it: on the device that copy must be an ATen copy (a host
// memcpy of fake memory crashes), and it must not bump the parameters' version counters
// (backward would refuse the saved views).
// A rank of its own (a process): on today's code the host memcpy crashes it (SIGSEGV), which
// the test reports instead of dying with it.
void one_rank_shard_to_full(bool bf16) {
  at::set_num_threads(1);
  Case c;
  c.model = Model::kTransformer;
  const auto data = make_data(c.model, 1);
  auto ref = make_model(c.model, 7);
  SingleDevice single(ref);
  train(c, single, *ref, data, 0, kLocalBatch, nullptr);
  run_contract(
      1, 0,
      [&](ContractRank& rk) {
        auto m = make_model(c.model, 7);
        m->to(contract_device());
        FsdpOptions o;
        o.wrap_policy = blocks_and_nested_up();
        if (bf16) o.mixed_precision.param_dtype = at::kBFloat16;
        FullyShardedDataParallel fsdp(m, rk.comm, o);
        train_on(c, fsdp, *m, data, 0, kLocalBatch, &fsdp, contract_device());
        auto state = fsdp.full_state_dict();
        for (auto& [name, t] : state) t = t.to(at::kCPU);
        expect_state_matches(state, *ref, bf16 ? 5e-2 : 1e-5, bf16 ? 2e-2 : 1e-6);
      },
      contract_device(), /*processes=*/true);
}

TEST(ContractFlatParam, OneRankShardToFullCopyIsAnAtenCopyFp32) { one_rank_shard_to_full(false); }
TEST(ContractFlatParam, OneRankShardToFullCopyIsAnAtenCopyBf16) { one_rank_shard_to_full(true); }

// ---- checkpoints ----

// A checkpoint written by FSDP (or DDP) at one world size through the contract, loaded at
// another world size through the contract and on a single CPU: same parameters and AdamW
// state as the writer's.
void checkpoint_round_trip(CheckpointFormat format, const std::string& writer, int write_world,
                           int read_world) {
  TempDir dir("ckpt_contract");
  std::map<std::string, at::Tensor> saved;  // rank 0's full state dict after the save
  std::mutex mu;
  auto make_strategy = [](const std::string& kind, std::shared_ptr<torch::nn::Module> m,
                          CommunicatorPtr comm) -> std::shared_ptr<Strategy> {
    if (kind == "ddp") return std::make_shared<DataParallel>(m, comm);
    FsdpOptions o;
    o.wrap_policy = blocks_and_nested_up();
    return std::make_shared<FullyShardedDataParallel>(m, comm, o);
  };
  auto full_state = [](Strategy& s, torch::nn::Module& m) {
    std::map<std::string, at::Tensor> out;
    if (auto* f = dynamic_cast<FullyShardedDataParallel*>(&s)) {
      const auto params = m.named_parameters();
      for (auto& [name, t] : f->full_state_dict()) {
        if (params.contains(name)) out[name] = t.to(at::kCPU);
      }
    } else {
      for (const auto& item : m.named_parameters()) out[item.key()] = item.value().to(at::kCPU);
    }
    return out;
  };
  auto opt_of = [](Strategy& s) {
    return std::make_unique<torch::optim::AdamW>(
        s.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-4));
  };
  run_contract(write_world, 0, [&](ContractRank& rk) {
    const int r = rk.comm->rank();
    auto m = make_model(Model::kTransformer, 7);
    m->to(contract_device());
    auto s = make_strategy(writer, m, rk.comm);
    auto opt = opt_of(*s);
    // Two optimizer steps on made-up gradients (the same on every rank; AdamW state on the
    // device). Not a backward: FSDP's backward needs a process per rank (run_contract), and
    // the checkpoint only needs state to save.
    for (int step = 0; step < 2; ++step) {
      int k = 0;
      for (auto& p : s->parameters()) {
        p.mutable_grad() = at::full_like(p, 0.01 * (++k + step)).detach();
      }
      opt->step();
    }
    TrainingState st;
    st.step = 2;
    CheckpointOptions o;
    o.format = format;
    save_checkpoint(dir.path().string(), *s, opt.get(), st, o);
    auto state = full_state(*s, *m);
    std::lock_guard<std::mutex> lock(mu);
    if (r == 0) saved = state;
  });
  const std::string path = latest_checkpoint(dir.path().string());
  auto expect_saved = [&](const std::map<std::string, at::Tensor>& got, const char* who) {
    DTRAIN_CHECK(got.size() == saved.size(), "{}: {} tensors, saved {}", who, got.size(),
                 saved.size());
    for (const auto& [name, want] : saved) {
      DTRAIN_CHECK(at::equal(got.at(name), want), "{}: {} differs after loading", who, name);
    }
  };
  run_contract(read_world, 0, [&](ContractRank& rk) {
    auto m = make_model(Model::kTransformer, 1);
    m->to(contract_device());
    auto s = make_strategy("fsdp", m, rk.comm);
    auto opt = opt_of(*s);
    TrainingState st = load_checkpoint(path, *s, opt.get());
    DTRAIN_CHECK(st.step == 2, "step {}", st.step);
    auto state = full_state(*s, *m);
    if (rk.comm->rank() == 0) expect_saved(state, "contract reader");
  });
  auto m = make_model(Model::kTransformer, 1);
  SingleDevice single(m);
  auto opt = opt_of(single);
  load_checkpoint(path, single, opt.get());
  expect_saved(full_state(single, *m), "single-device reader");
}

TEST(ContractCheckpoint, FullFsdp2ToFsdp4) {
  checkpoint_round_trip(CheckpointFormat::kFull, "fsdp", 2, 4);
}
TEST(ContractCheckpoint, ShardedFsdp4ToFsdp2) {
  checkpoint_round_trip(CheckpointFormat::kSharded, "fsdp", 4, 2);
}
TEST(ContractCheckpoint, FullDdp2ToFsdp4) {
  checkpoint_round_trip(CheckpointFormat::kFull, "ddp", 2, 4);
}
TEST(ContractCheckpoint, ShardedDdp4ToFsdp2) {
  checkpoint_round_trip(CheckpointFormat::kSharded, "ddp", 4, 2);
}

// ---- GradScaler ----

// A rank without gradients still takes part in the found-inf exchange (on the device), and
// every rank skips the step another rank found inf in.
TEST(ContractGradScaler, EveryRankSkipsWhatAnyRankFoundInfIn) {
  for (int world : {2, 4}) {
    run_contract(world, 0, [&](ContractRank& rk) {
      const int r = rk.comm->rank();
      at::Tensor p =
          at::zeros({3}, at::TensorOptions().device(contract_device()).requires_grad(true));
      torch::optim::AdamW opt({p});
      GradScaler scaler(rk.comm);
      if (r == 0)
        p.mutable_grad() =
            at::full({3}, std::numeric_limits<float>::infinity()).to(contract_device());
      if (r == 1) p.mutable_grad() = at::ones({3}).to(contract_device());
      // Ranks above 1 have no gradient at all.
      const bool stepped = scaler.step(opt);
      scaler.update();
      DTRAIN_CHECK(!stepped, "rank {} stepped although rank 0 found inf", r);
      DTRAIN_CHECK(scaler.state().skipped_steps == 1, "skipped {}", scaler.state().skipped_steps);
      opt.zero_grad();
      if (r == 1) p.mutable_grad() = at::ones({3}).to(contract_device());
      DTRAIN_CHECK(scaler.step(opt), "rank {} skipped a finite step", r);
      scaler.update();
    });
  }
}

// ---- a trainer-like step ----

// What gpt2_train does in a step, under DDP and FSDP through the contract: forward, backward
// of the scaled loss, unscale, clip_grad_norm (the global norm), the scaler's step and
// update, then the metrics exchange (each rank's loss, gathered on the communicator's
// device). The norm and the mean loss must equal single-device training's.
class ContractTrainerStep : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ContractTrainerStep, GradNormAndMetricsMatchSingleDevice) {
  const std::string kind = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  at::set_num_threads(1);
  const auto data = make_data(Model::kTransformer, world);
  const int64_t rows = kLocalBatch;
  auto ref = make_model(Model::kTransformer, 7);
  SingleDevice single(ref);
  const at::Tensor ref_loss = single.forward(
      [&] { return loss_of(Model::kTransformer, *ref, data[0].x, data[0].y, false); });
  single.backward(ref_loss);
  const double ref_norm = single.clip_grad_norm(1e9);
  // Built here: make_model seeds LibTorch's one global generator, which rank threads share.
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int r = 0; r < world; ++r) {
    modules.push_back(make_model(Model::kTransformer, r == 0 ? 7 : 100 + r));
    modules.back()->to(contract_device());
  }
  run_contract(
      world, 0,
      [&](ContractRank& rk) {
        const int r = rk.comm->rank();
        auto m = modules[r];
        std::shared_ptr<Strategy> s;
        if (kind == "ddp") {
          s = std::make_shared<DataParallel>(m, rk.comm);
        } else {
          FsdpOptions o;
          o.wrap_policy = blocks_and_nested_up();
          s = std::make_shared<FullyShardedDataParallel>(m, rk.comm, o);
        }
        torch::optim::AdamW opt(s->parameters(), torch::optim::AdamWOptions(1e-3));
        GradScaler scaler(rk.comm, GradScalerOptions{});
        at::Tensor x = data[0].x.narrow(0, r * rows, rows).to(contract_device());
        at::Tensor y = data[0].y.narrow(0, r * rows, rows).to(contract_device());
        at::Tensor loss = s->forward([&] { return loss_of(Model::kTransformer, *m, x, y, false); });
        s->backward(scaler.scale(loss));
        scaler.unscale(opt);
        const double norm = s->clip_grad_norm(1e9);
        DTRAIN_CHECK(scaler.step(opt), "step skipped");
        scaler.update();
        // The trainer's metrics: every rank's loss, gathered where the communicator takes tensors.
        const std::vector<double> losses =
            ControlPlane(*rk.comm).all_gather(std::vector<double>{loss.item<double>()});
        const double mean = std::accumulate(losses.begin(), losses.end(), 0.0) / world;
        DTRAIN_CHECK(std::abs(mean - ref_loss.item<double>()) < 1e-5, "mean loss {} vs {}", mean,
                     ref_loss.item<double>());
        DTRAIN_CHECK(std::abs(norm - ref_norm) < 1e-4 * ref_norm, "grad norm {} vs {}", norm,
                     ref_norm);
      },
      contract_device(), /*processes=*/kind == "fsdp");
}

INSTANTIATE_TEST_SUITE_P(Ranks, ContractTrainerStep,
                         ::testing::Combine(::testing::Values("ddp", "fsdp"),
                                            ::testing::Values(2, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace dtrain

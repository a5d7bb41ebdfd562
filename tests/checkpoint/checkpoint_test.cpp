// save_checkpoint / load_checkpoint across strategies and world sizes: a checkpoint written
// by single, DDP or FSDP (every sharding) on N ranks, in either form, loads under every
// other on M ranks (threads as ranks) with parameters, frozen parameters, buffers and AdamW
// state (moments and step counts) exactly equal, and the next step then matches the
// writer's next step. Plus the refusals: other model, other optimizer, corrupted files.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include <ATen/CPUGeneratorImpl.h>

#include "checkpoint/checkpoint_ranks.h"
#include "checkpoint/rng_states.h"
#include "checkpoint/safetensors.h"
#include "compat/torch_compat.h"
#include "dtrain/checkpoint.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/rendezvous.h"
#include "dtrain/single_device.h"
#include "strategy/training.h"
#include "support/check.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;
namespace fs = std::filesystem;

// Writers and readers: every strategy and sharding, world sizes 1 to 4 on both sides.
const std::vector<RankSetup>& writers() {
  static const std::vector<RankSetup> all = {
      {"single1", "single", 1},
      {"ddp2", "ddp", 2},
      {"fsdp_full3", "fsdp", 3, ShardingStrategy::kFullShard},
      {"fsdp_gradop3", "fsdp", 3, ShardingStrategy::kShardGradOp},
      {"fsdp_noshard2", "fsdp", 2, ShardingStrategy::kNoShard},
      {"fsdp_hybrid4", "fsdp", 4, ShardingStrategy::kHybridShard, 2},
      {"fsdp_full4", "fsdp", 4, ShardingStrategy::kFullShard},
  };
  return all;
}
const std::vector<RankSetup>& readers() {
  static const std::vector<RankSetup> all = {
      {"single1", "single", 1},
      {"ddp3", "ddp", 3},
      {"fsdp_full2", "fsdp", 2, ShardingStrategy::kFullShard},
      {"fsdp_gradop4", "fsdp", 4, ShardingStrategy::kShardGradOp},
      {"fsdp_noshard3", "fsdp", 3, ShardingStrategy::kNoShard},
      {"fsdp_hybrid4", "fsdp", 4, ShardingStrategy::kHybridShard, 2},
  };
  return all;
}

// Writer: two steps, save, a third step. Every reader: load, same state exactly, then a
// third step matching the writer's.
void any_to_any(CheckpointFormat format) {
  const auto data = global_batches();
  for (const RankSetup& w : writers()) {
    TempDir dir("ckpt_any");
    std::map<std::string, at::Tensor> saved, after;
    std::mutex mu;
    run_setup(w, [&](Rank& rk) {
      rk.step(data[0]);
      rk.step(data[1]);
      auto before = logical_state(rk);
      TrainingState st;
      st.step = 2;
      st.values["epoch"] = "1";
      st.tensors["ema"] = at::full({2}, 0.5);
      CheckpointOptions o;
      o.format = format;
      save_checkpoint(dir.path().string(), *rk.strategy, rk.opt.get(), st, o);
      rk.step(data[2]);
      auto next = logical_state(rk);
      std::lock_guard<std::mutex> lock(mu);
      if (rk.rank == 0) saved = before, after = next;
    });
    const std::string path = latest_checkpoint(dir.path().string());
    ASSERT_EQ(path, (dir.path() / "step_000000002").string());
    for (const RankSetup& r : readers()) {
      SCOPED_TRACE(w.name + " -> " + r.name);
      run_setup(r, [&](Rank& rk) {
        CheckpointStats stats;
        TrainingState st = load_checkpoint(path, *rk.strategy, rk.opt.get(), {}, &stats);
        DTRAIN_CHECK(st.step == 2 && st.values.at("epoch") == "1", "training state");
        DTRAIN_CHECK(at::equal(st.tensors.at("ema"), at::full({2}, 0.5)), "extra tensor");
        auto got = logical_state(rk);
        DTRAIN_CHECK(got.size() == saved.size(), "tensor count {} vs {}", got.size(), saved.size());
        for (const auto& [name, want] : saved) {
          DTRAIN_CHECK(at::equal(got.at(name), want), "rank {}: {} differs after the round trip",
                       rk.rank, name);
        }
        rk.step(data[2]);
        auto next = logical_state(rk);
        for (const auto& [name, want] : after) {
          if (name.rfind("step/", 0) == 0) {
            DTRAIN_CHECK(at::equal(next.at(name), want), "{} after the next step", name);
            continue;
          }
          DTRAIN_CHECK(at::allclose(next.at(name), want, 1e-4, 1e-6),
                       "rank {}: {} after the next step differs: max |diff| {}", rk.rank, name,
                       (next.at(name) - want).abs().max().item<double>());
        }
      });
    }
  }
}

TEST(Checkpoint, AnyToAnySharded) { any_to_any(CheckpointFormat::kSharded); }
TEST(Checkpoint, AnyToAnyFull) { any_to_any(CheckpointFormat::kFull); }

// Sharded FSDP: a rank writes and reads its share, never the whole model. The model is wide
// enough (about 72 MiB of parameters and AdamW moments, 18 MiB a share) that a rank writing
// or reading the whole state, or another rank's share too, exceeds the bounds by far more
// than the loader's fixed costs: it opens every rank's file for the replicated tensors
// (buffers, frozen parameters), whose pieces every rank writes, and verifying a piece reads
// its whole 1 MiB chunk, plus the chunk holding the file's header.
TEST(Checkpoint, ShardedFsdpBytesPerRank) {
  constexpr int kWorld = 4;
  constexpr int64_t kDim = 512;
  constexpr int64_t kChunk = 1 << 20;
  TempDir dir("ckpt_bytes");
  const auto data = global_batches();
  // The whole model state as one rank writes it (single device, same model and optimizer).
  int64_t whole = 0;
  run_setup({"single", "single", 1, ShardingStrategy::kFullShard, 0, kDim}, [&](Rank& rk) {
    rk.step(data[0]);
    TrainingState st;
    st.step = 1;
    whole = save_checkpoint((dir.path() / "single").string(), *rk.strategy, rk.opt.get(), st).bytes;
  });
  ASSERT_GT(whole, 64 * kChunk);
  std::vector<int64_t> written(kWorld), read(kWorld);
  RankSetup s{"fsdp_full4", "fsdp", kWorld, ShardingStrategy::kFullShard, 0, kDim};
  const std::string sharded = (dir.path() / "fsdp").string();
  run_setup(s, [&](Rank& rk) {
    rk.step(data[0]);
    TrainingState st;
    st.step = 1;
    written[rk.rank] = save_checkpoint(sharded, *rk.strategy, rk.opt.get(), st).bytes;
    CheckpointStats ls;
    load_checkpoint(latest_checkpoint(sharded), *rk.strategy, rk.opt.get(), {}, &ls);
    read[rk.rank] = ls.bytes;
  });
  const int64_t share = whole / kWorld;
  int64_t total = 0;
  for (int r = 0; r < kWorld; ++r) {
    total += written[r];
    // A share, plus padding to the world size and the headers (rank 0 also writes the
    // replicated extras: buffers, frozen parameters, step counts: a few KiB here).
    EXPECT_GT(written[r], share * 9 / 10) << "rank " << r;
    EXPECT_LT(written[r], share * 11 / 10) << "rank " << r;
    // Its own share, plus at most two chunks of every file.
    EXPECT_LT(read[r], written[r] + kWorld * 2 * kChunk) << "rank " << r;
  }
  // Nothing is written twice: the shards add up to the whole state.
  EXPECT_LT(total, whole * 21 / 20);
  EXPECT_GT(total, whole * 19 / 20);
}

// Refusals: every message is one line naming the file and the problem, and nothing is
// loaded into the model when a check fails.
TEST(Checkpoint, RefusesMismatchedAndCorruptedCheckpoints) {
  TempDir dir("ckpt_bad");
  const std::string d = dir.path().string();
  auto module = make_ckpt_model();
  SingleDevice single(module);
  const auto data = global_batches();
  Rank rk{module, std::shared_ptr<Strategy>(&single, [](Strategy*) {}), nullptr, 0, 1};
  rk.opt =
      std::make_unique<torch::optim::AdamW>(single.parameters(), torch::optim::AdamWOptions(1e-2));
  rk.step(data[0]);
  TrainingState st;
  st.step = 1;
  save_checkpoint(d, single, rk.opt.get(), st);
  const std::string path = latest_checkpoint(d);
  const std::string file = path + "/rank00000.safetensors";

  auto expect_refused = [&](Strategy& s, torch::optim::Optimizer* o,
                            std::initializer_list<std::string> parts) {
    const at::Tensor before = module->named_parameters()["h0.qkv.weight"].clone();
    try {
      load_checkpoint(path, s, o);
      ADD_FAILURE() << "loaded; expected " << *parts.begin();
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
    EXPECT_TRUE(at::equal(before, module->named_parameters()["h0.qkv.weight"]));
  };

  // Another model shape.
  {
    torch::manual_seed(1);
    auto other = TinyTransformer(50, 8, 24, 2, 2).ptr();
    SingleDevice s(other);
    expect_refused(s, nullptr,
                   {"MANIFEST", "model mismatch",
                    "\"wte.weight\" is F32 [50, 16] in the "
                    "checkpoint but F32 [50, 24] in the model"});
  }
  // Another optimizer.
  {
    torch::optim::SGD sgd(single.parameters(), torch::optim::SGDOptions(0.1));
    expect_refused(single, &sgd, {"optimizer mismatch", "AdamW state, the optimizer is SGD"});
  }
  // The same optimizer type in two parameter groups where the checkpoint has one.
  {
    auto params = single.parameters();
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>(params.begin(), params.begin() + 2));
    groups.emplace_back(std::vector<at::Tensor>(params.begin() + 2, params.end()));
    torch::optim::AdamW two(std::move(groups), torch::optim::AdamWOptions(1e-2));
    expect_refused(single, &two, {"optimizer mismatch", "1 parameter group(s), the optimizer 2"});
  }
  // A flipped byte in the data file: refused by its checksum.
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  auto rewrite = [&](const std::string& b) {
    std::ofstream(file, std::ios::binary | std::ios::trunc)
        .write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  std::string flipped = bytes;
  flipped[flipped.size() - 5] ^= 0x10;
  rewrite(flipped);
  expect_refused(single, rk.opt.get(), {file, "checksum mismatch"});
  rewrite(bytes.substr(0, bytes.size() - 100));
  expect_refused(single, rk.opt.get(), {file, "truncated"});
  // A file of another checkpoint swapped in: same size is unlikely; checksums refuse it.
  rewrite(std::string(bytes.size(), 'x'));
  expect_refused(single, rk.opt.get(), {file, "checksum mismatch"});
  rewrite(bytes);
  EXPECT_NO_THROW(load_checkpoint(path, single, rk.opt.get()));
  // Not a checkpoint at all.
  fs::remove(path + "/MANIFEST");
  expect_refused(single, nullptr, {path, "MANIFEST", "missing"});
}

// Two ranks saving sharded FSDP checkpoints through the public API; one rank is killed at
// each point of the second save. Until every rank's files are durable and rank 0 has renamed
// the temporary directory, the first checkpoint stays the latest and loads (checksums
// verified) with its values. A rank killed after its files are durable ("files_written" on
// rank 1) no longer stops rank 0 from committing the complete second checkpoint. Never a
// partial checkpoint, whichever rank dies.
// Random generators (rng_states.h): CUDA generators follow the CPU one's rules. CPU
// generators stand in for CUDA devices' so that the rules run without a GPU.
checkpoint::Generators stand_in_generators(int cuda_devices, uint64_t seed) {
  checkpoint::Generators g;
  g.cpu = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int d = 0; d < cuda_devices; ++d) {
    g.cuda.push_back(at::make_generator<at::CPUGeneratorImpl>(seed + 100 + d));
  }
  return g;
}

// The next draw of a generator: equal draws, equal states.
double draw(at::Generator g) { return at::rand({1}, g).item<double>(); }

SafetensorsReader write_and_open(const TempDir& dir,
                                 const std::vector<std::pair<std::string, at::Tensor>>& entries) {
  const std::string path = dir / "extra.safetensors";
  checkpoint::write_safetensors(path, entries);
  return SafetensorsReader(path);
}

TEST(CheckpointRng, CudaStatesRoundTripWhenTheDeviceCountMatches) {
  TempDir dir("rng_roundtrip");
  const auto saved = stand_in_generators(2, 1);
  draw(saved.cuda[1]);  // states that differ from a fresh generator's
  const checkpoint::RngStates states = checkpoint::capture(saved);
  std::vector<std::pair<std::string, at::Tensor>> extra;
  checkpoint::append_rng_entries(3, states, extra);
  auto reader = write_and_open(dir, extra);
  ASSERT_NE(reader.find("rng/cpu/3"), nullptr);
  ASSERT_NE(reader.find("rng/cuda/3/1"), nullptr);
  EXPECT_EQ(reader.read("rng/cuda_count/3").item<int64_t>(), 2);
  EXPECT_FALSE(checkpoint::read_rng_entries(reader, 0).has_value());  // another rank's
  const auto loaded = checkpoint::read_rng_entries(reader, 3);
  ASSERT_TRUE(loaded.has_value());
  ASSERT_EQ(loaded->cuda.size(), 2u);

  const auto target = stand_in_generators(2, 50);
  EXPECT_EQ(checkpoint::restore(target, *loaded), checkpoint::CudaRestore::kRestored);
  EXPECT_EQ(draw(target.cpu), draw(saved.cpu));
  EXPECT_EQ(draw(target.cuda[0]), draw(saved.cuda[0]));
  EXPECT_EQ(draw(target.cuda[1]), draw(saved.cuda[1]));
}

TEST(CheckpointRng, OtherDeviceCountRestoresTheCpuAndLeavesCudaGenerators) {
  TempDir dir("rng_count");
  const auto saved = stand_in_generators(2, 1);
  std::vector<std::pair<std::string, at::Tensor>> extra;
  checkpoint::append_rng_entries(0, checkpoint::capture(saved), extra);
  auto reader = write_and_open(dir, extra);
  const auto loaded = checkpoint::read_rng_entries(reader, 0);
  ASSERT_TRUE(loaded.has_value());
  for (int devices : {0, 1, 3}) {
    const auto target = stand_in_generators(devices, 50);
    const auto untouched = stand_in_generators(devices, 50);
    EXPECT_EQ(checkpoint::restore(target, *loaded), checkpoint::CudaRestore::kCountDiffers)
        << devices;
    // A fresh twin of `saved` (whose own state the draws below would advance).
    EXPECT_EQ(draw(target.cpu), draw(stand_in_generators(2, 1).cpu)) << devices;
    for (int d = 0; d < devices; ++d) {
      EXPECT_EQ(draw(target.cuda[d]), draw(untouched.cuda[d])) << devices << " device " << d;
    }
  }
}

TEST(CheckpointRng, CheckpointsWithoutCudaStatesReadAsZeroCudaGenerators) {
  TempDir dir("rng_old");
  const auto saved = stand_in_generators(0, 1);
  // The format before CUDA generators were saved: "rng/cpu/<r>" alone.
  auto reader = write_and_open(dir, {{"rng/cpu/0", checkpoint::capture(saved).cpu}});
  const auto loaded = checkpoint::read_rng_entries(reader, 0);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_TRUE(loaded->cuda.empty());
  const auto cpu_only = stand_in_generators(0, 50);
  EXPECT_EQ(checkpoint::restore(cpu_only, *loaded), checkpoint::CudaRestore::kNone);
  EXPECT_EQ(draw(cpu_only.cpu), draw(saved.cpu));
  const auto with_gpus = stand_in_generators(1, 50);
  EXPECT_EQ(checkpoint::restore(with_gpus, *loaded), checkpoint::CudaRestore::kCountDiffers);
}

TEST(CheckpointRng, MissingCudaEntryIsACheckpointError) {
  TempDir dir("rng_missing");
  const auto states = checkpoint::capture(stand_in_generators(2, 1));
  auto reader = write_and_open(dir, {{"rng/cpu/0", states.cpu},
                                     {"rng/cuda_count/0", at::full({1}, int64_t{2}, at::kLong)},
                                     {"rng/cuda/0/0", states.cuda[0]}});
  try {
    checkpoint::read_rng_entries(reader, 0);
    ADD_FAILURE() << "read a checkpoint with a CUDA state missing";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("rng/cuda/0/1 is missing"), std::string::npos) << e.what();
  }
}

// Ranks that see different numbers of GPUs: rank 0 gets every rank's states intact.
TEST(CheckpointRng, GatherCarriesEveryRanksStatesToRankZero) {
  run_ranks(3, [](Communicator& comm) {
    const auto mine = checkpoint::capture(stand_in_generators(comm.rank(), 10 * comm.rank() + 1));
    const auto all = checkpoint::gather_rng_states(&comm, mine);
    if (comm.rank() != 0) {
      DTRAIN_CHECK(all.empty(), "only rank 0 receives the states");
      return;
    }
    DTRAIN_CHECK(all.size() == 3, "one entry per rank");
    for (int r = 0; r < 3; ++r) {
      const auto want = checkpoint::capture(stand_in_generators(r, 10 * r + 1));
      DTRAIN_CHECK(at::equal(all[r].cpu, want.cpu), "rank {} CPU state", r);
      DTRAIN_CHECK(all[r].cuda.size() == static_cast<size_t>(r), "rank {} CUDA count", r);
      for (int d = 0; d < r; ++d) {
        DTRAIN_CHECK(at::equal(all[r].cuda[d], want.cuda[d]), "rank {} device {}", r, d);
      }
    }
  });
}

// Through save_checkpoint on this machine: every rank records its CUDA generator count (zero
// without a GPU), and a load at the same world size restores the CPU generator. (Thread ranks
// share the process's generators, so the restore is checked with one rank.)
TEST(CheckpointRng, SavedCheckpointRecordsEachRanksCudaGeneratorCount) {
  TempDir dir("rng_e2e");
  const int devices = cuda_device_count();
  run_setup(RankSetup{"ddp2", "ddp", 2}, [&](Rank& rk) {
    TrainingState st;
    st.step = 1;
    save_checkpoint(dir.path().string(), *rk.strategy, rk.opt.get(), st);
  });
  SafetensorsReader reader(
      (fs::path(latest_checkpoint(dir.path().string())) / "extra.safetensors").string());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(reader.read(fmt::format("rng/cuda_count/{}", r)).item<int64_t>(), devices);
    EXPECT_EQ(reader.find(fmt::format("rng/cuda/{}/{}", r, devices)), nullptr);
  }

  TempDir one("rng_e2e_single");
  double after_save = 0;
  run_setup(RankSetup{"single", "single", 1}, [&](Rank& rk) {
    TrainingState st;
    st.step = 1;
    at::manual_seed(1234);
    save_checkpoint(one.path().string(), *rk.strategy, rk.opt.get(), st);
    after_save = at::rand({1}).item<double>();
    at::manual_seed(99);
    load_checkpoint(latest_checkpoint(one.path().string()), *rk.strategy, rk.opt.get());
    DTRAIN_CHECK(at::rand({1}).item<double>() == after_save, "CPU generator restored");
  });
}

TEST(CheckpointKill, RankKilledAtAnyPointOfAShardedSaveLeavesALoadableCheckpoint) {
  struct Kill {
    const char* point;
    int rank;
  };
  for (const Kill k :
       {Kill{"tmp_created", 1}, Kill{"mid_file", 0}, Kill{"mid_file", 1}, Kill{"files_written", 0},
        Kill{"files_written", 1}, Kill{"before_rename", 0}, Kill{"renamed", 0}}) {
    SCOPED_TRACE(std::string(k.point) + " on rank " + std::to_string(k.rank));
    TempDir dir("ckrankkill");
    const std::string d = (dir.path() / "ckpts").string();
    const int port = free_port();
    std::vector<Process> ranks;
    for (int r = 0; r < 2; ++r) {
      auto env = rank_env(r, 2, port);
      env["DTRAIN_TEST_PAUSE_AT"] = k.point;
      env["DTRAIN_TEST_PAUSE_RANK"] = std::to_string(k.rank);
      ranks.push_back(
          spawn_process({DTRAIN_TEST_WORKER, "sharded_checkpoint_writer", "20000", d}, env));
    }
    const fs::path flag = dir.path() / ("paused." + std::to_string(k.rank));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
    while (!fs::exists(flag) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(fs::exists(flag)) << "the writer never reached " << k.point;
    ::kill(ranks[k.rank].pid, SIGKILL);
    // The survivor fails on the lost peer (or finishes); either way it must not write a
    // checkpoint that the killed rank did not complete.
    for (auto& p : ranks) wait_process(p, 60);

    const std::string point = k.point;
    const int64_t want = point == "renamed" || (point == "files_written" && k.rank != 0) ? 2 : 1;
    const std::string latest = latest_checkpoint(d);
    ASSERT_EQ(latest, (fs::path(d) / fmt::format("step_{:09d}", want)).string());
    auto module = make_model(Model::kTransformer, 99);
    SingleDevice single(module);
    const TrainingState st = load_checkpoint(latest, single, nullptr);
    EXPECT_EQ(st.step, want);
    for (const auto& item : module->named_parameters()) {
      EXPECT_TRUE(item.value().eq(static_cast<float>(want)).all().item<bool>()) << item.key();
    }
  }
}

}  // namespace
}  // namespace dtrain

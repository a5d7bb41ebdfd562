// Streamed --init_from and --export (load_hf_safetensors, export_hf_safetensors over a
// strategy): under single-device, DDP and FSDP (several shardings and world sizes) the
// loaded values equal the file's bit for bit, the streamed export writes the same bytes as
// the single-device export, and each rank reads exactly the bytes of the elements it holds.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/data_parallel.h"
#include "dtrain/deferred_init.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/safetensors.h"
#include "dtrain/single_device.h"
#include "dtrain/store.h"
#include "hf_weights.h"
#include "model.h"

namespace gpt2 {
namespace {

GptConfig config(int64_t dim = 32) {
  GptConfig c;
  c.vocab_size = 96;
  c.context = 16;
  c.layers = 3;
  c.heads = 2;
  c.dim = dim;
  return c;
}

// A file name of this process's (ctest may run tests of several builds at once).
std::string temp_file(const std::string& name) {
  return ::testing::TempDir() + "hf_stream_" + std::to_string(getpid()) + "_" + name;
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// fn(rank, comm) on `world` threads over one in-memory store; the first error is rethrown.
void run_world(int world, const std::function<void(int, dtrain::CommunicatorPtr)>& fn) {
  auto store = dtrain::make_memory_store();
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, dtrain::make_communicator(store, r, world));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

struct StreamSetup {
  std::string name;
  std::string strategy;  // single | ddp | fsdp
  int world = 1;
  dtrain::ShardingStrategy sharding = dtrain::ShardingStrategy::kFullShard;
  bool use_orig_params = true;
};

// The strategy of `s` over a GPT-2 of `c` initialised with seed 5 (deferred under FSDP).
std::shared_ptr<dtrain::Strategy> make_strategy(const StreamSetup& s, const GptConfig& c,
                                                dtrain::CommunicatorPtr comm) {
  GptConfig g = c;
  g.deferred = s.strategy == "fsdp";
  Gpt model(g);
  const dtrain::DeferredInit init = param_init(c, 5);
  if (s.strategy == "single") {
    dtrain::init_parameters(*model, init);
    return std::make_shared<dtrain::SingleDevice>(model.ptr());
  }
  if (s.strategy == "ddp") {
    dtrain::init_parameters(*model, init);
    return std::make_shared<dtrain::DataParallel>(model.ptr(), comm);
  }
  dtrain::FsdpOptions o;
  o.sharding = s.sharding;
  o.wrap_policy = dtrain::wrap_modules_named("BlockImpl");
  o.use_orig_params = s.use_orig_params;
  o.deferred_init = init;
  return std::make_shared<dtrain::FullyShardedDataParallel>(model.ptr(), comm, o);
}

bool conv1d(const std::string& name) {
  for (const char* t :
       {"c_attn.weight", "attn.c_proj.weight", "c_fc.weight", "mlp.c_proj.weight"}) {
    const std::string tail(t);
    if (name.size() >= tail.size() &&
        name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
      return true;
  }
  return false;
}

// The bytes a rank holding `layout` must read: its elements, and for a Conv1D weight (stored
// transposed) its whole rows of ours, each one contiguous run per row of the file.
int64_t expected_bytes(const dtrain::StateLayout& layout) {
  int64_t n = 0;
  for (const auto& s : layout.slices) {
    if (s.kind == dtrain::StateSlice::Kind::kBuffer || s.end <= s.begin) continue;
    if (!conv1d(s.name)) {
      n += (s.end - s.begin) * 4;
      continue;
    }
    const int64_t cols = s.shape[1];
    const int64_t r0 = s.begin / cols, r1 = (s.end - 1) / cols + 1;
    n += (r1 - r0) * cols * 4;
  }
  return n;
}

TEST(HfStream, LoadsEachRanksShareBitForBitAndExportsTheSameBytes) {
  const GptConfig c = config();
  // The file: a single-device model with another seed than the strategies' initialisation.
  Gpt source(c);
  dtrain::init_parameters(*source, param_init(c, 11));
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& item : source->named_parameters()) params.emplace_back(item.key(), item.value());
  const std::string file = temp_file("source.safetensors");
  export_hf_safetensors(file, params);
  const std::string want_bytes = file_bytes(file);
  uint64_t data_bytes = 0;
  const dtrain::SafetensorsReader source_reader(file);
  for (const auto& t : source_reader.tensors()) data_bytes += t.nbytes();

  const std::vector<StreamSetup> setups = {
      {"single1", "single", 1},
      {"ddp2", "ddp", 2},
      {"fsdp_full2", "fsdp", 2, dtrain::ShardingStrategy::kFullShard},
      {"fsdp_full4", "fsdp", 4, dtrain::ShardingStrategy::kFullShard, false},
      {"fsdp_gradop3", "fsdp", 3, dtrain::ShardingStrategy::kShardGradOp},
      {"fsdp_noshard2", "fsdp", 2, dtrain::ShardingStrategy::kNoShard},
  };
  for (const StreamSetup& s : setups) {
    SCOPED_TRACE(s.name);
    const std::string out = temp_file(s.name + ".safetensors");
    std::vector<HfLoadStats> stats(s.world);
    std::vector<int64_t> expected(s.world), exported(s.world);
    std::map<std::string, at::Tensor> loaded;  // rank 0's full parameters after the load
    run_world(s.world, [&](int rank, dtrain::CommunicatorPtr comm) {
      auto strategy = make_strategy(s, c, comm);
      expected[rank] = expected_bytes(strategy->state_layout());
      stats[rank] = load_hf_safetensors(file, *strategy);
      if (auto* fsdp = dynamic_cast<dtrain::FullyShardedDataParallel*>(strategy.get())) {
        auto full = fsdp->full_state_dict();
        if (rank == 0) loaded.insert(full.begin(), full.end());
      } else if (rank == 0) {
        for (const auto& sl : strategy->state_layout().slices) {
          loaded[sl.name] = sl.data.view(sl.shape).clone();
        }
      }
      exported[rank] = export_hf_safetensors(out, *strategy);
    });
    for (const auto& [name, want] : params) {
      ASSERT_TRUE(loaded.count(name)) << name;
      EXPECT_TRUE(at::equal(loaded.at(name), want)) << name;
    }
    EXPECT_EQ(exported[0], static_cast<int64_t>(params.size()));
    EXPECT_EQ(file_bytes(out), want_bytes);
    std::remove(out.c_str());
    uint64_t total = 0;
    for (int r = 0; r < s.world; ++r) {
      EXPECT_EQ(stats[r].bytes_read, expected[r]) << "rank " << r;
      total += static_cast<uint64_t>(stats[r].bytes_read);
      if (r > 0) {
        EXPECT_EQ(exported[r], 0) << "rank " << r;
      }
      if (s.strategy != "fsdp" || s.sharding == dtrain::ShardingStrategy::kNoShard) {
        EXPECT_EQ(static_cast<uint64_t>(stats[r].bytes_read), data_bytes) << "rank " << r;
      } else {
        // A shard: about 1/world of the file (unit padding and Conv1D rows aside).
        EXPECT_LT(static_cast<uint64_t>(stats[r].bytes_read), data_bytes / s.world * 12 / 10)
            << "rank " << r;
      }
    }
    if (s.strategy == "fsdp" && s.sharding != dtrain::ShardingStrategy::kNoShard) {
      // Nothing read twice but the partial Conv1D rows at shard boundaries.
      EXPECT_LT(total, data_bytes * 11 / 10);
    }
  }
  std::remove(file.c_str());
}

TEST(HfStream, MismatchedFileIsRefusedOnEveryRankBeforeAnythingIsWritten) {
  Gpt source(config(16));
  dtrain::init_parameters(*source, param_init(config(16), 11));
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& item : source->named_parameters()) params.emplace_back(item.key(), item.value());
  const std::string file = temp_file("small.safetensors");
  export_hf_safetensors(file, params);
  const StreamSetup s{"fsdp_full2", "fsdp", 2};
  std::vector<std::string> errors(2);
  std::vector<bool> unchanged(2, false);
  run_world(2, [&](int rank, dtrain::CommunicatorPtr comm) {
    auto strategy = make_strategy(s, config(32), comm);
    std::vector<at::Tensor> before;
    for (const auto& sl : strategy->state_layout().slices) before.push_back(sl.data.clone());
    try {
      load_hf_safetensors(file, *strategy);
    } catch (const dtrain::CheckpointError& e) {
      errors[rank] = e.what();
    }
    bool same = true;
    const auto after = strategy->state_layout();
    for (size_t i = 0; i < before.size(); ++i) same &= at::equal(before[i], after.slices[i].data);
    unchanged[rank] = same;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find(file + ": transformer.wte.weight has shape [96, 16] but the model's "
                                    "wte.weight needs [96, 32]"),
              std::string::npos)
        << errors[r];
    EXPECT_TRUE(unchanged[r]) << "rank " << r;
  }
  std::remove(file.c_str());
}

}  // namespace
}  // namespace gpt2

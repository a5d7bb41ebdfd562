// Background checkpoints (Checkpointer with CheckpointOptions::async): the same directory,
// byte for byte, as a foreground save of the same state; the state as it was at the call
// (the copy), whatever the training does meanwhile; a failed write reported on every rank
// with the rank and the cause, at wait() or at the next save; the write complete when the
// Checkpointer is destroyed; and an exact load.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "checkpoint/checkpoint_ranks.h"
#include "checkpoint/progress.h"
#include "dtrain/checkpoint.h"
#include "dtrain/errors.h"
#include "support/check.h"
#include "support/temp_dir.h"

namespace dtrain {
namespace {

using namespace dtrain::testing;
namespace fs = std::filesystem;

// Every file below `dir` (relative path -> bytes).
std::map<std::string, std::string> tree_bytes(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::stringstream ss;
    ss << std::ifstream(e.path(), std::ios::binary).rdbuf();
    out[fs::relative(e.path(), dir).string()] = ss.str();
  }
  return out;
}

TrainingState state_at(int64_t step) {
  TrainingState st;
  st.step = step;
  st.values["epoch"] = "1";
  st.tensors["ema"] = at::full({3}, 0.25);
  return st;
}

// A foreground and a background save of the same state write the same bytes, in both forms,
// under DDP (replicated, split between the ranks) and sharded FSDP.
TEST(AsyncCheckpoint, ForegroundAndBackgroundSavesAreByteIdentical) {
  const auto data = global_batches();
  for (const CheckpointFormat format : {CheckpointFormat::kSharded, CheckpointFormat::kFull}) {
    for (const RankSetup& setup : {RankSetup{"ddp2", "ddp", 2}, RankSetup{"fsdp3", "fsdp", 3}}) {
      SCOPED_TRACE(setup.name + (format == CheckpointFormat::kFull ? " full" : " sharded"));
      TempDir fg("ck_fg"), bg("ck_bg");
      run_setup(setup, [&](Rank& rk) {
        rk.step(data[0]);
        rk.step(data[1]);
        CheckpointOptions o;
        o.format = format;
        save_checkpoint(fg.path().string(), *rk.strategy, rk.opt.get(), state_at(2), o);
        o.async = true;
        Checkpointer ckpt(bg.path().string(), o);
        const CheckpointStats copy = ckpt.save(*rk.strategy, rk.opt.get(), state_at(2));
        DTRAIN_CHECK(copy.bytes == 0 && ckpt.in_flight(), "a background save returned");
        const CheckpointStats written = ckpt.wait();
        DTRAIN_CHECK(!ckpt.in_flight(), "waited");
        DTRAIN_CHECK(written.path == (bg.path() / "step_000000002").string(), "path {}",
                     written.path);
        DTRAIN_CHECK(written.bytes > 0 || (format == CheckpointFormat::kFull && rk.rank != 0),
                     "rank {} wrote {} bytes", rk.rank, written.bytes);
      });
      const auto a = tree_bytes(fg.path()), b = tree_bytes(bg.path());
      ASSERT_FALSE(a.empty());
      std::set<std::string> names_a, names_b;
      for (const auto& [name, bytes] : a) names_a.insert(name);
      for (const auto& [name, bytes] : b) names_b.insert(name);
      ASSERT_EQ(names_a, names_b);
      for (const auto& [name, bytes] : a) EXPECT_TRUE(bytes == b.at(name)) << name << " differs";
    }
  }
}

// The checkpoint holds the state at the call: the model and optimizer change (two more
// steps) while the write runs, and a load gives back the state of the save, exactly; the
// next step from it matches the original run's.
TEST(AsyncCheckpoint, HoldsTheStateAtTheCallAndLoadsExactly) {
  const auto data = global_batches();
  for (const CheckpointFormat format : {CheckpointFormat::kSharded, CheckpointFormat::kFull}) {
    TempDir dir("ck_async_exact");
    std::map<std::string, at::Tensor> saved, after;
    std::mutex mu;
    const RankSetup fsdp{"fsdp2", "fsdp", 2};
    run_setup(fsdp, [&](Rank& rk) {
      rk.step(data[0]);
      rk.step(data[1]);
      auto before = logical_state(rk);
      // The write stops half way (its "mid_file" point, on the background thread) until the
      // training has moved on: the second half is written after the model changed.
      std::atomic<bool> moved_on{false};
      CheckpointOptions o;
      o.format = format;
      o.async = true;
      detail::CheckpointProgress::set(o, [&](const char* point) {
        if (std::string(point) != "mid_file") return;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!moved_on && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
      Checkpointer ckpt(dir.path().string(), o);
      ckpt.save(*rk.strategy, rk.opt.get(), state_at(2));
      rk.step(data[2]);  // while the write runs
      auto next = logical_state(rk);
      rk.step(data[0]);
      moved_on = true;
      ckpt.wait();
      std::lock_guard<std::mutex> lock(mu);
      if (rk.rank == 0) saved = before, after = next;
    });
    const std::string path = latest_checkpoint(dir.path().string());
    ASSERT_EQ(path, (dir.path() / "step_000000002").string());
    run_setup({"ddp2", "ddp", 2}, [&](Rank& rk) {
      const TrainingState st = load_checkpoint(path, *rk.strategy, rk.opt.get());
      DTRAIN_CHECK(st.step == 2 && at::equal(st.tensors.at("ema"), at::full({3}, 0.25)),
                   "training state");
      auto got = logical_state(rk);
      for (const auto& [name, want] : saved) {
        DTRAIN_CHECK(at::equal(got.at(name), want), "rank {}: {} is not the saved state", rk.rank,
                     name);
      }
      rk.step(data[2]);
      auto next = logical_state(rk);
      for (const auto& [name, want] : after) {
        DTRAIN_CHECK(at::allclose(next.at(name), want, 1e-4, 1e-6),
                     "rank {}: {} after the next step differs", rk.rank, name);
      }
    });
  }
}

// Rank 1's data file cannot be written (a link to /dev/full: every write fails with ENOSPC,
// as a full disk does). The save returns (the write is in the background); wait() throws on
// both ranks, rank 1 naming itself and the cause, rank 0 naming rank 1 and the cause; no
// checkpoint becomes visible; the directory takes the next save.
TEST(AsyncCheckpoint, FailedBackgroundWriteIsReportedWithRankAndCause) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const auto data = global_batches();
  TempDir dir("ck_async_fail");
  std::vector<std::string> errors(2), next_save(2);
  run_setup({"ddp2", "ddp", 2}, [&](Rank& rk) {
    rk.step(data[0]);
    CheckpointOptions o;
    o.async = true;
    detail::CheckpointProgress::set(o, [&](const char* point) {
      if (std::string(point) != "tmp_created" || rk.rank != 1) return;
      fs::create_symlink("/dev/full", dir.path() / ".tmp-step_000000001" / "rank00001.safetensors");
    });
    {
      Checkpointer ckpt(dir.path().string(), o);
      ckpt.save(*rk.strategy, rk.opt.get(), state_at(1));
      try {
        ckpt.wait();
      } catch (const CheckpointError& e) {
        errors[static_cast<size_t>(rk.rank)] = e.what();
      }
      DTRAIN_CHECK(!ckpt.in_flight(), "the failed write is over");
      // The same failure surfaces at the next save when nobody waited.
      ckpt.save(*rk.strategy, rk.opt.get(), state_at(1));
      try {
        ckpt.save(*rk.strategy, rk.opt.get(), state_at(2));
      } catch (const CheckpointError& e) {
        next_save[static_cast<size_t>(rk.rank)] = e.what();
      }
    }
    DTRAIN_CHECK(latest_checkpoint(dir.path().string()).empty(), "a failed save became visible");
    // A save without the fault succeeds in the same directory.
    detail::CheckpointProgress::set(o, nullptr);
    Checkpointer ckpt(dir.path().string(), o);
    ckpt.save(*rk.strategy, rk.opt.get(), state_at(3));
    ckpt.wait();
  });
  for (const auto* msgs : {&errors, &next_save}) {
    const std::string& r1 = (*msgs)[1];
    const std::string& r0 = (*msgs)[0];
    EXPECT_NE(r1.find("rank 1/2 save_checkpoint (background write of step 1)"), std::string::npos)
        << r1;
    EXPECT_NE(r1.find("rank00001.safetensors: write failed: No space left on device"),
              std::string::npos)
        << r1;
    EXPECT_NE(r0.find("rank 0/2 save_checkpoint (background write of step 1)"), std::string::npos)
        << r0;
    EXPECT_NE(r0.find("rank 1 failed to write its files"), std::string::npos) << r0;
    EXPECT_NE(r0.find("No space left on device"), std::string::npos) << r0;
  }
  EXPECT_EQ(latest_checkpoint(dir.path().string()), (dir.path() / "step_000000003").string());
}

// Background saves one after another copy into the previous save's host buffers
// (keep_host_buffers, the default): each checkpoint still holds its own state, byte for byte
// the directory a foreground save of that state writes, with the buffers kept or not, under
// DDP and sharded FSDP.
TEST(AsyncCheckpoint, SavesIntoKeptHostBuffersHoldTheirOwnState) {
  const auto data = global_batches();
  for (const bool keep : {true, false}) {
    for (const RankSetup& setup : {RankSetup{"ddp2", "ddp", 2}, RankSetup{"fsdp2", "fsdp", 2}}) {
      SCOPED_TRACE(setup.name + (keep ? " keep_host_buffers" : " fresh buffers"));
      TempDir fg("ck_reuse_fg"), bg("ck_reuse_bg");
      run_setup(setup, [&](Rank& rk) {
        CheckpointOptions o;
        o.keep = 5;
        CheckpointOptions b = o;
        b.async = true;
        b.keep_host_buffers = keep;
        Checkpointer ckpt(bg.path().string(), b);
        for (int64_t step = 1; step <= 3; ++step) {
          rk.step(data[static_cast<size_t>(step - 1)]);
          save_checkpoint(fg.path().string(), *rk.strategy, rk.opt.get(), state_at(step), o);
          ckpt.save(*rk.strategy, rk.opt.get(), state_at(step));
        }
        rk.step(data[0]);  // while the last write runs
        ckpt.wait();
      });
      const auto a = tree_bytes(fg.path()), b = tree_bytes(bg.path());
      ASSERT_EQ(a.size(), b.size());
      for (const auto& [name, bytes] : a) {
        ASSERT_TRUE(b.count(name) == 1) << name << " is missing";
        EXPECT_TRUE(bytes == b.at(name)) << name << " differs";
      }
    }
  }
}

// A second save while one is in flight waits for it; destroying the Checkpointer completes
// the write in flight: both checkpoints are complete afterwards, and nothing is left over.
TEST(AsyncCheckpoint, SecondSaveWaitsAndDestructorCompletesTheWrite) {
  const auto data = global_batches();
  TempDir dir("ck_async_two");
  run_setup({"fsdp2", "fsdp", 2}, [&](Rank& rk) {
    CheckpointOptions o;
    o.async = true;
    o.keep = 5;
    Checkpointer ckpt(dir.path().string(), o);
    rk.step(data[0]);
    ckpt.save(*rk.strategy, rk.opt.get(), state_at(1));
    rk.step(data[1]);
    ckpt.save(*rk.strategy, rk.opt.get(), state_at(2));
    DTRAIN_CHECK(ckpt.in_flight(), "the second save is in flight");
  });  // ~Checkpointer on every rank
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_000000001", "step_000000002"}));
  EXPECT_EQ(latest_checkpoint(dir.path().string()), (dir.path() / "step_000000002").string());
  run_setup({"single1", "single", 1}, [&](Rank& rk) {
    const TrainingState st =
        load_checkpoint(latest_checkpoint(dir.path().string()), *rk.strategy, rk.opt.get());
    DTRAIN_CHECK(st.step == 2, "step {}", st.step);
  });
}

TEST(AsyncCheckpoint, SaveCheckpointRefusesAsync) {
  TempDir dir("ck_async_refused");
  run_setup({"single1", "single", 1}, [&](Rank& rk) {
    CheckpointOptions o;
    o.async = true;
    try {
      save_checkpoint(dir.path().string(), *rk.strategy, rk.opt.get(), state_at(1), o);
      DTRAIN_CHECK(false, "save_checkpoint accepted async");
    } catch (const InvalidArgument& e) {
      DTRAIN_CHECK(std::string(e.what()).find("dtrain::Checkpointer") != std::string::npos, "{}",
                   e.what());
    }
  });
}

}  // namespace
}  // namespace dtrain

// Checkpointer: saves in the foreground (the steps of save.h one after the other, each
// agreed by the ranks) or in the background. A background save copies the state to host
// memory on the caller's thread (plan_save with copy, the only part that blocks the step),
// then one thread per rank writes its files and publishes its sidecar; rank 0's thread waits
// for every rank's sidecar (or error file) in the temporary directory and commits. Nothing
// in the background talks to the communicator: collectives stay on the training thread, in
// the order every rank issues them, and the ranks agree on the write's outcome in wait().
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "checkpoint/agreement.h"
#include "checkpoint/directory.h"
#include "checkpoint/files.h"
#include "checkpoint/layout.h"
#include "checkpoint/save.h"
#include "dtrain/checkpoint.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace ck = checkpoint;
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return e.cause();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

// The background write in flight.
struct Checkpointer::Write {
  ck::SaveJob job;
  std::chrono::milliseconds timeout{0};
  std::atomic<bool> abandon{false};  // the owner is unwinding: stop waiting for other ranks
  std::exception_ptr error;          // set by the thread, read after join()
  double seconds = 0;                // the background part
  std::thread thread;

  ErrorContext context() const {
    return ErrorContext{job.rank, job.world,
                        fmt::format("save_checkpoint (background write of step {})", job.step), -1};
  }

  // Rank 0: until every rank's sidecar is there; a rank's error file, the timeout or the
  // owner's abandon ends the wait with a CheckpointError.
  void wait_for_ranks() const {
    const auto deadline = Clock::now() + timeout;
    for (int r = 0; r < job.world; ++r) {
      const fs::path side = fs::path(job.tmp) / ck::sidecar_file(r);
      const fs::path failed = fs::path(job.tmp) / ck::error_file(r);
      auto pause = std::chrono::milliseconds(1);
      for (;;) {
        std::error_code ec;
        if (fs::exists(side, ec)) break;
        if (fs::exists(failed, ec)) {
          throw CheckpointError(fmt::format("rank {} failed to write its files: {}", r,
                                            ck::read_small_file(failed.string(), 1 << 16)));
        }
        if (abandon) {
          throw CheckpointError(fmt::format(
              "abandoned before rank {}'s files were written (the Checkpointer was destroyed by "
              "an exception)",
              r));
        }
        if (Clock::now() > deadline) {
          throw CheckpointError(
              fmt::format("rank {}'s files did not appear in {} within {} ms (CheckpointOptions::"
                          "async_timeout)",
                          r, job.tmp, timeout.count()));
        }
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(50));
      }
    }
  }

  void run() {
    const auto t0 = Clock::now();
    try {
      if (job.full) ck::write_full_copied(job);
      ck::write_extra(job);
      ck::write_rank_files(job);  // its sidecar last: this rank's "done"
      job.progress("files_written");
      if (job.rank == 0) {
        wait_for_ranks();
        ck::commit(job);
      }
    } catch (...) {
      error = std::current_exception();
      if (job.rank != 0) {
        // Rank 0 waits for this rank's sidecar: tell it why none comes (best effort; it
        // times out otherwise).
        try {
          ck::write_small_file((fs::path(job.tmp) / ck::error_file(job.rank)).string(),
                               message_of(error));
        } catch (...) {
        }
      }
    }
    seconds = seconds_since(t0);
  }
};

Checkpointer::Checkpointer(std::string dir, CheckpointOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {}

Checkpointer::~Checkpointer() {
  if (!write_) return;
  if (std::uncaught_exceptions() > 0) write_->abandon = true;
  write_->thread.join();
  if (write_->error) {
    // wait() was not called to report it: say it here rather than lose it.
    const Error e(write_->context(), message_of(write_->error));
    std::fprintf(stderr, "%s (reported by ~Checkpointer: wait() was not called)\n", e.what());
  }
}

bool Checkpointer::in_flight() const { return write_ != nullptr; }

CheckpointStats Checkpointer::wait() {
  if (!write_) return {};
  write_->thread.join();
  const std::unique_ptr<Write> w = std::move(write_);
  if (options_.keep_host_buffers && w->job.copied && !w->job.full) {
    // The written copy's buffers, for the next save to copy into (pages already mapped).
    for (const ck::Piece& p : w->job.pieces) host_buffers_.push_back(p.data);
  }
  const ck::Ranks ranks(w->job.comm);
  ranks.agreed("save_checkpoint: background write", [&] {
    if (w->error) throw CheckpointError(w->context(), message_of(w->error));
  });
  CheckpointStats stats;
  stats.path = (fs::path(w->job.dir) / ck::step_dir_name(w->job.step)).string();
  stats.bytes = w->job.bytes;
  stats.seconds = w->seconds;
  return stats;
}

CheckpointStats Checkpointer::save(Strategy& strategy, torch::optim::Optimizer* optimizer,
                                   const TrainingState& state) {
  wait();  // one write at a time; the previous one's error surfaces here
  const auto t0 = Clock::now();
  CheckpointStats stats;
  stats.path = (fs::path(dir_) / ck::step_dir_name(state.step)).string();
  if (!options_.async) {
    ck::SaveJob job = ck::plan_save(dir_, strategy, optimizer, state, options_, /*copy=*/false);
    const ck::Ranks ranks(job.comm);
    ranks.agreed("save_checkpoint: write", [&] {
      if (!job.full) {
        ck::write_rank_files(job);
      } else {
        ck::write_full_streaming(job, ranks);
      }
      ck::write_extra(job);
    });
    job.progress("files_written");
    ranks.agreed("save_checkpoint: commit", [&] { ck::commit(job); });
    stats.bytes = job.bytes;
    stats.seconds = seconds_since(t0);
    return stats;
  }
  auto w = std::make_unique<Write>();
  w->job = ck::plan_save(dir_, strategy, optimizer, state, options_, /*copy=*/true, host_buffers_);
  host_buffers_.clear();  // now the job's pieces: never written into while it writes
  w->timeout = options_.async_timeout;
  Write* raw = w.get();
  w->thread = std::thread([raw] { raw->run(); });
  write_ = std::move(w);
  stats.seconds = seconds_since(t0);
  return stats;
}

}  // namespace dtrain

// The process's MPI as dtrain uses it: who initialized it, the thread level it provides, the one
// lock every dtrain MPI call holds, and the progress thread. MPI is one per process, so this is
// too (Runtime::get); everything else about a communicator lives in its engine.
//
// Thread model (docs/communication.md, "MPI"). dtrain never requires MPI_THREAD_MULTIPLE:
//  * every MPI call dtrain makes holds mpi_lock(), so dtrain's own calls are serialized;
//  * a progress thread advances calls in the background (MpiProgress::kThread) only where MPI
//    lets a thread other than the application's call it while the application calls MPI too:
//    at MPI_THREAD_MULTIPLE, or at MPI_THREAD_SERIALIZED when dtrain initialized MPI (then the
//    application makes no MPI call of its own);
//  * otherwise calls advance on the threads that call dtrain (MpiProgress::kCaller): a call
//    starts when it is issued, and moves on whenever a dtrain call, Work::wait() or
//    Work::is_completed() runs. At MPI_THREAD_FUNNELED those must come from the main thread.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "comm/mpi/mpi_types.h"
#include "dtrain/errors.h"

namespace dtrain::mpi_backend {

// Something the progress thread advances: an engine with calls in flight.
class Progressable {
 public:
  virtual ~Progressable() = default;
  // Moves this engine's calls on without blocking; true while some are still in flight.
  virtual bool advance() = 0;
};

class Runtime {
 public:
  // The process's runtime. With `may_initialize`, initializes MPI when nothing has yet: dtrain
  // then owns it (asks for MPI_THREAD_MULTIPLE, works with any level it gets, and calls
  // MPI_Finalize when the process exits). Throws InvalidArgument(ctx) when MPI was finalized,
  // or is not initialized and `may_initialize` is false; CommError when MPI_Init_thread fails.
  static std::shared_ptr<Runtime> get(bool may_initialize, const ErrorContext& ctx);

  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE, as MPI provides it.
  int thread_level() const { return thread_level_; }
  bool owns_mpi() const { return owns_; }
  // Whether a dtrain thread may drive calls (see the thread model above).
  bool progress_thread_allowed() const;
  // Whether MPI_Finalize has run (by dtrain or by the application): no MPI call is allowed.
  bool finalized() const;
  const Reductions& reductions() const { return *reductions_; }
  // Held by every MPI call dtrain makes.
  std::mutex& mpi_lock() { return mpi_mu_; }

  // The progress thread advances attached engines while any has calls in flight; wake() after
  // queueing a call. detach() returns once the thread no longer touches `engine`.
  void attach(Progressable* engine);
  void detach(Progressable* engine);
  void wake();

  // A call was left in flight (it timed out, or a peer failed): its buffers stay with MPI, and
  // MPI_Finalize might wait for it forever, so a dtrain-owned MPI is then not finalized.
  void note_abandoned();

  // "MPI_THREAD_FUNNELED".
  static const char* level_name(int level);

 private:
  Runtime(bool owns, int level);
  // MPI_Finalize's first step (an attribute of MPI_COMM_SELF): stops the thread, frees the
  // reductions while MPI still accepts calls.
  static int on_finalize(MPI_Comm, int, void*, void*);
  void stop_thread();
  void loop();

  const bool owns_;
  const int thread_level_;
  std::optional<Reductions> reductions_;
  std::mutex mpi_mu_;

  mutable std::mutex mu_;  // the fields below
  std::condition_variable cv_;
  std::vector<Progressable*> engines_;
  bool kicked_ = false;
  bool stop_ = false;
  // Atomic: read by engines while the thread advances them under mu_.
  std::atomic<bool> finalized_{false};
  std::atomic<bool> abandoned_{false};
  std::thread thread_;  // started by the first attach()
};

}  // namespace dtrain::mpi_backend

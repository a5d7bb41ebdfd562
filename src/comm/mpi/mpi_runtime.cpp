#include "comm/mpi/mpi_runtime.h"

#include <fmt/format.h>

#include <algorithm>

namespace dtrain::mpi_backend {

std::shared_ptr<Runtime> Runtime::get(bool may_initialize, const ErrorContext& ctx) {
  // MPI is one per process, and so is what dtrain keeps of it: made on first use, kept until
  // the process exits (a dtrain-owned MPI is finalized then).
  static std::mutex mu;
  static std::shared_ptr<Runtime> runtime;
  std::lock_guard<std::mutex> lock(mu);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) {
    throw InvalidArgument(ctx,
                          "MPI is already finalized: create MPI communicators before "
                          "MPI_Finalize");
  }
  if (runtime) return runtime;
  int initialized = 0;
  MPI_Initialized(&initialized);
  int level = MPI_THREAD_SINGLE;
  bool owns = false;
  if (initialized != 0) {
    MPI_Query_thread(&level);
  } else {
    if (!may_initialize) {
      throw InvalidArgument(ctx,
                            "MPI is not initialized: call MPI_Init_thread (or MPI_Init) "
                            "before init_communicator(MPI_Comm)");
    }
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &level);
    if (rc != MPI_SUCCESS) throw CommError(ctx, "MPI_Init_thread: " + error_string(rc));
    owns = true;
  }
  runtime.reset(new Runtime(owns, level));
  return runtime;
}

Runtime::Runtime(bool owns, int level) : owns_(owns), thread_level_(level) {
  reductions_.emplace();
  // MPI_Finalize deletes MPI_COMM_SELF's attributes first: the last moment to free what dtrain
  // made, whoever finalizes.
  int keyval = MPI_KEYVAL_INVALID;
  MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &Runtime::on_finalize, &keyval, nullptr);
  MPI_Comm_set_attr(MPI_COMM_SELF, keyval, this);
}

Runtime::~Runtime() {
  stop_thread();
  if (owns_ && !finalized() && !abandoned_.load()) {
    std::lock_guard<std::mutex> lock(mpi_mu_);
    MPI_Finalize();
  }
}

int Runtime::on_finalize(MPI_Comm, int, void* value, void*) {
  auto* self = static_cast<Runtime*>(value);
  self->stop_thread();
  self->reductions_.reset();
  self->finalized_.store(true);
  return MPI_SUCCESS;
}

bool Runtime::progress_thread_allowed() const {
  return thread_level_ == MPI_THREAD_MULTIPLE || (owns_ && thread_level_ == MPI_THREAD_SERIALIZED);
}

bool Runtime::finalized() const { return finalized_.load(); }

void Runtime::note_abandoned() { abandoned_.store(true); }

void Runtime::attach(Progressable* engine) {
  std::lock_guard<std::mutex> lock(mu_);
  engines_.push_back(engine);
  if (!thread_.joinable() && !stop_) thread_ = std::thread([this] { loop(); });
}

void Runtime::detach(Progressable* engine) {
  // The thread holds mu_ while it advances engines: once this has it, none is being advanced.
  std::lock_guard<std::mutex> lock(mu_);
  engines_.erase(std::remove(engines_.begin(), engines_.end(), engine), engines_.end());
}

void Runtime::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    kicked_ = true;
  }
  cv_.notify_one();
}

void Runtime::stop_thread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Runtime::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || kicked_; });
    if (stop_) return;
    kicked_ = false;
    bool busy = false;
    for (Progressable* engine : engines_) busy = engine->advance() || busy;
    if (busy) {
      // Calls in flight: poll again, letting the application's threads run in between (MPI's
      // own blocking waits spin the same way).
      kicked_ = true;
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    }
  }
}

const char* Runtime::level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return "an unknown thread level";
  }
}

}  // namespace dtrain::mpi_backend

#include "comm/mpi/mpi_engine.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/call_header.h"
#include "comm/cpu_work.h"
#include "comm/reduce/reduce_ops.h"

namespace dtrain::mpi_backend {
namespace {

using Clock = std::chrono::steady_clock;
using detail::CallHeader;
using detail::Collective;
using detail::CollectiveOp;
using detail::CpuWork;
using detail::PointToPoint;

// Throws CommError(ctx) when an MPI call failed (the communicators return errors instead of
// aborting: MPI_ERRORS_RETURN).
void check_mpi(int rc, const ErrorContext& ctx, const char* call) {
  if (rc != MPI_SUCCESS) throw CommError(ctx, fmt::format("{}: {}", call, error_string(rc)));
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// In caller mode dtrain calls MPI on the caller's thread: at MPI_THREAD_FUNNELED (and SINGLE)
// only the main thread may.
void check_caller_thread(const Runtime& runtime, const ErrorContext& ctx) {
  const int level = runtime.thread_level();
  if (level > MPI_THREAD_FUNNELED) return;
  int is_main = 0;
  MPI_Is_thread_main(&is_main);
  if (is_main == 0) {
    throw InvalidArgument(ctx, fmt::format("MPI provides {}: call dtrain's MPI communicator (and "
                                           "wait for its Work) from the thread that initialized "
                                           "MPI",
                                           Runtime::level_name(level)));
  }
}

// One call on its way through MPI: an explicit state machine, advanced by Pipeline::advance.
struct Call {
  enum class Phase {
    kQueued,  // not started
    kHeader,  // headers being all-gathered (collectives of more than one rank)
    kData,    // the data operation in flight
    kDone,
  };
  Phase phase = Phase::kQueued;
  bool collective = true;
  Collective coll;
  PointToPoint p2p;
  std::shared_ptr<CpuWork> work;
  CallHeader mine;
  std::vector<CallHeader> headers;
  at::Tensor staged;  // a copy of an input that overlaps the output
  MPI_Request request = MPI_REQUEST_NULL;
  // An all-reduce or reduce-scatter in pieces (Pipeline::kPieceBytes): those in flight, the
  // reduce-scatter's packed inputs of those, and the first output element not started yet.
  std::deque<MPI_Request> pieces;
  std::deque<at::Tensor> packed;
  int64_t next = 0;
  // Every MPI operation of the call's data started: later calls may start theirs.
  bool all_started = false;

  bool holds_requests() const { return request != MPI_REQUEST_NULL || !pieces.empty(); }
  Clock::time_point deadline;

  const ErrorContext& context() const { return collective ? coll.context : p2p.context; }
  std::chrono::milliseconds timeout() const { return collective ? coll.timeout : p2p.timeout; }
};

// The calls of one communicator and the two MPI communicators they run on.
class Pipeline final : public Progressable {
 public:
  Pipeline(std::shared_ptr<Runtime> runtime, MPI_Comm data, MPI_Comm headers, int rank, int world,
           std::shared_ptr<detail::StickyFailure> failure)
      : runtime_(std::move(runtime)),
        data_(data),
        headers_(headers),
        rank_(rank),
        world_(world),
        failure_(std::move(failure)) {}

  void submit(Call call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto error = failure_->check(call.context())) {
      call.work->finish(error);
      return;
    }
    calls_.push_back(std::move(call));
  }

  bool advance() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (calls_.empty() || runtime_->finalized()) return false;
    std::lock_guard<std::mutex> mpi(runtime_->mpi_lock());
    bool header_pending = false;      // an earlier collective has not started its data
    bool collective_pending = false;  // an earlier collective has not completed
    for (Call& call : calls_) {
      try {
        step(call, header_pending, collective_pending);
      } catch (...) {
        fail_all(call, std::current_exception());
        return false;
      }
      if (call.collective && call.phase != Call::Phase::kDone) {
        collective_pending = true;
        if (!call.all_started) header_pending = true;
      }
    }
    for (auto it = calls_.begin(); it != calls_.end();) {
      it = it->phase == Call::Phase::kDone ? calls_.erase(it) : it + 1;
    }
    return !calls_.empty();
  }

  // Waits (driving the calls itself) until every call completed or failed by its deadline, then
  // frees the communicators unless MPI still holds a call on them.
  void shutdown() {
    while (advance()) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu_);
    if (runtime_->finalized() || !abandoned_.empty()) return;
    std::lock_guard<std::mutex> mpi(runtime_->mpi_lock());
    MPI_Comm_free(&headers_);
    MPI_Comm_free(&data_);
  }

  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::shared_ptr<Runtime>& runtime() const { return runtime_; }

 private:
  void step(Call& call, bool header_pending, bool collective_pending) {
    const ErrorContext& ctx = call.context();
    if (call.phase == Call::Phase::kQueued) {
      call.deadline = Clock::now() + call.timeout();
      if (!call.collective) {
        start_point_to_point(call);
      } else if (world_ == 1) {
        call.phase = Call::Phase::kHeader;  // nothing to compare
      } else {
        call.headers.resize(static_cast<size_t>(world_));
        check_mpi(MPI_Iallgather(&call.mine, sizeof(CallHeader), MPI_BYTE, call.headers.data(),
                                 sizeof(CallHeader), MPI_BYTE, headers_, &call.request),
                  ctx, "MPI_Iallgather (call header)");
        call.phase = Call::Phase::kHeader;
      }
    }
    if (call.phase == Call::Phase::kHeader) {
      if (!test(call)) return expire(call);
      if (!call.headers.empty()) {  // compared once; cleared so a call held back skips it
        if (auto mismatch = detail::find_mismatch(call.headers)) throw DesyncError(ctx, *mismatch);
        call.headers.clear();
      }
      if (header_pending) return expire(call);
      start_collective(call);
    }
    if (call.phase == Call::Phase::kData) {
      if (call.collective && collective_pending) return expire(call);
      MPI_Status status;
      if (!test(call, &status) || !pieces_done(call)) return expire(call);
      finish(call, status);
    }
  }

  // Large all-reduces and reduce-scatters run as pieces of about this many bytes per rank,
  // this many in flight: Open MPI's nonblocking collectives (libnbc) lose most of their
  // bandwidth on messages far beyond the caches (docs/benchmarks.md, "MPI backend").
  static constexpr int64_t kPieceBytes = 256 << 10;
  static constexpr size_t kPiecesInFlight = 4;

  // Elements of the call's output per piece.
  int64_t piece_elements(const Collective& c) const {
    const int64_t per = c.op == CollectiveOp::kReduceScatter ? world_ : 1;
    return std::max<int64_t>(1,
                             kPieceBytes / (static_cast<int64_t>(c.tensor.element_size()) * per));
  }

  // Starts pieces of `call` while fewer than kPiecesInFlight are in flight. A reduce-scatter's
  // piece reduces the same columns of every rank's block, packed into one buffer first.
  void feed(Call& call) {
    const Collective& c = call.coll;
    const at::Tensor& t = c.tensor;
    const int64_t total = t.numel();
    const int64_t step = piece_elements(c);
    const MPI_Datatype type = datatype(t.scalar_type());
    const MPI_Op op = runtime_->reductions().op(t.scalar_type(), c.reduce);
    auto* base = static_cast<char*>(t.data_ptr());
    while (call.next < total && call.pieces.size() < kPiecesInFlight) {
      const int64_t n = std::min(step, total - call.next);
      void* out = base + call.next * static_cast<int64_t>(t.element_size());
      MPI_Request r = MPI_REQUEST_NULL;
      if (c.op == CollectiveOp::kAllReduce) {
        check_mpi(MPI_Iallreduce(MPI_IN_PLACE, out, static_cast<int>(n), type, op, data_, &r),
                  c.context, "MPI_Iallreduce");
      } else {
        const at::Tensor& input = call.staged.defined() ? call.staged : c.input;
        at::Tensor packed = input.view({world_, total}).narrow(1, call.next, n).contiguous();
        check_mpi(MPI_Ireduce_scatter_block(packed.data_ptr(), out, static_cast<int>(n), type, op,
                                            data_, &r),
                  c.context, "MPI_Ireduce_scatter_block");
        call.packed.push_back(std::move(packed));
      }
      call.pieces.push_back(r);
      call.next += n;
    }
    call.all_started = call.next >= total;
  }

  // Whether every piece of `call` completed (true for calls not in pieces); starts more.
  bool pieces_done(Call& call) {
    while (!call.pieces.empty()) {
      int done = 0;
      MPI_Status status;
      const int rc = MPI_Test(&call.pieces.front(), &done, &status);
      if (rc != MPI_SUCCESS) {
        throw CommError(call.context(), fmt::format("MPI_Test: {}", error_string(rc)));
      }
      if (done == 0) break;
      call.pieces.pop_front();
      if (!call.packed.empty()) call.packed.pop_front();
      if (!call.all_started) feed(call);
    }
    return call.pieces.empty();
  }

  // Whether call.request completed (a null request has); throws what MPI reports.
  bool test(Call& call, MPI_Status* status = nullptr) {
    if (call.request == MPI_REQUEST_NULL) return true;
    int done = 0;
    MPI_Status local;
    MPI_Status* s = status != nullptr ? status : &local;
    const int rc = MPI_Test(&call.request, &done, s);
    if (rc != MPI_SUCCESS) {
      const int code = rc == MPI_ERR_IN_STATUS ? s->MPI_ERROR : rc;
      throw CommError(call.context(), fmt::format("MPI_Test: {}", error_string(code)));
    }
    return done != 0;
  }

  void expire(const Call& call) const {
    if (Clock::now() < call.deadline) return;
    const auto ms = call.timeout().count();
    if (!call.collective) {
      throw TimeoutError(
          call.context(),
          fmt::format("{} rank {} (tag {}) not completed within {} ms",
                      call.p2p.is_send ? "send to" : "recv from", call.p2p.peer, call.p2p.tag, ms));
    }
    throw TimeoutError(
        call.context(),
        fmt::format("not completed within {} ms{}: a rank has not issued it, or "
                    "is stuck before it",
                    ms, call.phase == Call::Phase::kHeader ? " (call headers)" : ""));
  }

  void start_point_to_point(Call& call) {
    const PointToPoint& p = call.p2p;
    const int count = static_cast<int>(p.tensor.numel());
    const MPI_Datatype type = datatype(p.tensor.scalar_type());
    const int tag = static_cast<int>(p.tag);
    if (p.is_send) {
      check_mpi(MPI_Isend(p.tensor.data_ptr(), count, type, p.peer, tag, data_, &call.request),
                p.context, "MPI_Isend");
    } else {
      check_mpi(MPI_Irecv(p.tensor.data_ptr(), count, type, p.peer, tag, data_, &call.request),
                p.context, "MPI_Irecv");
    }
    call.phase = Call::Phase::kData;
  }

  void start_collective(Call& call) {
    const Collective& c = call.coll;
    const ErrorContext& ctx = c.context;
    const MPI_Datatype type =
        c.tensor.defined() ? datatype(c.tensor.scalar_type()) : MPI_DATATYPE_NULL;
    const int count = c.tensor.defined() ? static_cast<int>(c.tensor.numel()) : 0;
    const MPI_Op op = c.tensor.defined()
                          ? runtime_->reductions().op(c.tensor.scalar_type(), c.reduce)
                          : MPI_OP_NULL;
    if (c.op == CollectiveOp::kReduceScatter && overlaps(c.input, c.tensor)) {
      call.staged = c.input.clone();  // MPI reads the input while it writes the output
    }
    const bool reduction = c.op == CollectiveOp::kAllReduce || c.op == CollectiveOp::kReduceScatter;
    if (reduction && c.tensor.numel() > piece_elements(c)) {
      call.phase = Call::Phase::kData;
      feed(call);
      return;
    }
    switch (c.op) {
      case CollectiveOp::kAllReduce:
        check_mpi(MPI_Iallreduce(MPI_IN_PLACE, c.tensor.data_ptr(), count, type, op, data_,
                                 &call.request),
                  ctx, "MPI_Iallreduce");
        break;
      case CollectiveOp::kBroadcast:
        check_mpi(MPI_Ibcast(c.tensor.data_ptr(), count, type, c.root, data_, &call.request), ctx,
                  "MPI_Ibcast");
        break;
      case CollectiveOp::kAllGather: {
        const int n = static_cast<int>(c.input.numel());
        const auto* slot = static_cast<const char*>(c.tensor.data_ptr()) +
                           static_cast<int64_t>(rank_) * c.input.nbytes();
        const void* send = c.input.data_ptr();
        if (n > 0 && send == slot) {
          send = MPI_IN_PLACE;  // the input already sits in this rank's slot of the output
        } else if (overlaps(c.input, c.tensor)) {
          call.staged = c.input.clone();
          send = call.staged.data_ptr();
        }
        check_mpi(MPI_Iallgather(send, n, type, c.tensor.data_ptr(), n, type, data_, &call.request),
                  ctx, "MPI_Iallgather");
        break;
      }
      case CollectiveOp::kReduceScatter: {
        const void* send = (call.staged.defined() ? call.staged : c.input).data_ptr();
        check_mpi(MPI_Ireduce_scatter_block(send, c.tensor.data_ptr(), count, type, op, data_,
                                            &call.request),
                  ctx, "MPI_Ireduce_scatter_block");
        break;
      }
      case CollectiveOp::kBarrier:
        check_mpi(MPI_Ibarrier(data_, &call.request), ctx, "MPI_Ibarrier");
        break;
    }
    call.all_started = true;
    call.phase = Call::Phase::kData;
  }

  void finish(Call& call, const MPI_Status& status) {
    if (!call.collective && !call.p2p.is_send) {
      int count = 0;
      MPI_Get_count(&status, datatype(call.p2p.tensor.scalar_type()), &count);
      if (count != call.p2p.tensor.numel()) {
        throw CommError(call.p2p.context,
                        fmt::format("recv from rank {} (tag {}): got {} elements, expected {}",
                                    call.p2p.peer, call.p2p.tag, count, call.p2p.tensor.numel()));
      }
    }
    if (call.collective && call.coll.reduce == ReduceOp::kAvg &&
        (call.coll.op == CollectiveOp::kAllReduce ||
         call.coll.op == CollectiveOp::kReduceScatter)) {
      call.coll.tensor.div_(world_);
    }
    call.phase = Call::Phase::kDone;
    call.staged = at::Tensor();
    call.work->finish();
  }

  // `failed` threw `error`: it fails with it, every other call with after_failure. A recv is
  // taken back; MPI keeps the other calls in flight, with their tensors (abandoned_).
  void fail_all(const Call& failed, std::exception_ptr error) {
    error = detail::as_comm_error(failed.context(), error);
    failure_->record(error);
    for (Call& call : calls_) {
      if (call.phase == Call::Phase::kDone) continue;
      const std::exception_ptr e =
          &call == &failed ? error : detail::after_failure(call.context(), failure_->first());
      const std::shared_ptr<CpuWork> work = call.work;
      if (call.request != MPI_REQUEST_NULL && !call.collective && !call.p2p.is_send) {
        MPI_Cancel(&call.request);
        MPI_Wait(&call.request, MPI_STATUS_IGNORE);  // a cancelled recv completes at once
      }
      if (call.holds_requests()) {
        runtime_->note_abandoned();
        abandoned_.push_back(std::move(call));
      }
      work->finish(e);
    }
    calls_.clear();
  }

  const std::shared_ptr<Runtime> runtime_;
  MPI_Comm data_;
  MPI_Comm headers_;
  const int rank_;
  const int world_;
  std::shared_ptr<detail::StickyFailure> failure_;

  std::mutex mu_;  // calls_, abandoned_; taken before the runtime's MPI lock
  std::deque<Call> calls_;
  std::vector<Call> abandoned_;  // in flight in MPI after a failure: never freed
};

class MpiEngine final : public detail::CollectiveEngine {
 public:
  MpiEngine(std::shared_ptr<Pipeline> pipeline, bool progress_thread, int tag_ub)
      : pipeline_(std::move(pipeline)), progress_thread_(progress_thread), tag_ub_(tag_ub) {
    if (progress_thread_) pipeline_->runtime()->attach(pipeline_.get());
  }

  ~MpiEngine() override {
    if (progress_thread_) pipeline_->runtime()->detach(pipeline_.get());
    pipeline_->shutdown();
  }

  const char* name() const override { return "mpi"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }

  void check_tensor(const at::Tensor& t, const ErrorContext& ctx, const char* what) const override {
    if (!t.device().is_cpu()) {
      throw InvalidArgument(
          ctx, fmt::format("{}: the MPI backend needs CPU tensors, got {} (set "
                           "CommunicatorOptions::device to stage them through host memory)",
                           what, t.device().str()));
    }
    if (!reduce::is_supported_dtype(t.scalar_type())) {
      throw InvalidArgument(
          ctx, fmt::format("{}: dtype {} is not supported", what, c10::toString(t.scalar_type())));
    }
  }

  void check_call(const Collective& call) const override {
    check_thread(call.context);
    // The count MPI gets: all_gather's per-rank input, reduce_scatter's per-rank output.
    check_count(call.op == CollectiveOp::kAllGather ? call.input : call.tensor, call.context);
  }

  void check_call(const PointToPoint& call) const override {
    check_thread(call.context);
    check_count(call.tensor, call.context);
    if (call.tag > static_cast<uint32_t>(tag_ub_)) {
      throw InvalidArgument(
          call.context,
          fmt::format("tag {} is above this MPI's largest tag {} (MPI_TAG_UB)", call.tag, tag_ub_));
    }
  }

  WorkPtr start(Collective call) override {
    Call c;
    c.collective = true;
    if (pipeline_->world() > 1) c.mine = call.header;
    c.work = make_work(call.context, call.timeout, {call.tensor, call.input});
    c.coll = std::move(call);
    return submit(std::move(c));
  }

  WorkPtr start(PointToPoint call) override {
    Call c;
    c.collective = false;
    c.work = make_work(call.context, call.timeout, {call.tensor});
    c.p2p = std::move(call);
    return submit(std::move(c));
  }

 private:
  std::shared_ptr<CpuWork> make_work(const ErrorContext& ctx, std::chrono::milliseconds timeout,
                                     std::vector<at::Tensor> keep) {
    const auto seq = static_cast<uint64_t>(ctx.sequence);
    const auto bound = detail::host_wait_bound(timeout);
    if (progress_thread_) {
      return std::make_shared<CpuWork>(seq, ctx.op, ctx, bound, std::move(keep));
    }
    std::weak_ptr<Pipeline> weak = pipeline_;
    return std::make_shared<CpuWork>(seq, ctx.op, ctx, bound, std::move(keep), [weak, ctx] {
      if (auto p = weak.lock()) {
        check_caller_thread(*p->runtime(), ctx);
        p->advance();
      }
    });
  }

  WorkPtr submit(Call call) {
    auto work = call.work;
    pipeline_->submit(std::move(call));
    if (progress_thread_) {
      pipeline_->runtime()->wake();
    } else {
      pipeline_->advance();  // starts it now: peers may be waiting for it
    }
    return work;
  }

  // MPI counts elements in an int.
  static void check_count(const at::Tensor& t, const ErrorContext& ctx) {
    if (t.defined() && t.numel() > INT_MAX) {
      throw InvalidArgument(ctx, fmt::format("{} elements: MPI moves at most {} per rank and call "
                                             "(split the tensor)",
                                             t.numel(), INT_MAX));
    }
  }

  void check_thread(const ErrorContext& ctx) const {
    if (!progress_thread_) check_caller_thread(*pipeline_->runtime(), ctx);
  }

  std::shared_ptr<Pipeline> pipeline_;
  const bool progress_thread_;
  const int tag_ub_;
};

}  // namespace

std::unique_ptr<detail::CollectiveEngine> make_mpi_engine(
    std::shared_ptr<Runtime> runtime, MPI_Comm comm, const CommunicatorOptions& options,
    std::shared_ptr<detail::StickyFailure> failure, const ErrorContext& ctx) {
  const bool allowed = runtime->progress_thread_allowed();
  if (options.mpi_progress == MpiProgress::kThread && !allowed) {
    {
      std::lock_guard<std::mutex> mpi(runtime->mpi_lock());
      MPI_Comm_free(&comm);
    }
    throw InvalidArgument(
        ctx, fmt::format("mpi_progress kThread: MPI provides {} and was initialized by the "
                         "application, so no dtrain thread may call it (MPI_THREAD_MULTIPLE "
                         "allows it; kAuto or kCaller work at any level)",
                         Runtime::level_name(runtime->thread_level())));
  }
  const bool use_thread = options.mpi_progress == MpiProgress::kThread ||
                          (options.mpi_progress == MpiProgress::kAuto && allowed);
  MPI_Comm headers = MPI_COMM_NULL;
  int rank = 0, world = 1, tag_ub = 32767;  // the least MPI_TAG_UB the standard allows
  {
    std::lock_guard<std::mutex> mpi(runtime->mpi_lock());
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    check_mpi(MPI_Comm_dup(comm, &headers), ctx, "MPI_Comm_dup");
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &world);
    void* value = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &found);
    if (found != 0) tag_ub = *static_cast<int*>(value);
  }
  auto pipeline = std::make_shared<Pipeline>(std::move(runtime), comm, headers, rank, world,
                                             std::move(failure));
  return std::make_unique<MpiEngine>(std::move(pipeline), use_thread, tag_ub);
}

}  // namespace dtrain::mpi_backend

// Communicator: collective and point-to-point communication among a fixed set of ranks.
//
// Contract shared by every backend:
//  * Every call is asynchronous and returns a Work (see work.h).
//  * Calls execute in the order they were issued; every rank must issue the same
//    collectives, with the same sizes and dtypes, in the same order. Each call gets the
//    next sequence number; errors name it so a divergence can be located.
//  * Consistency (Gloo): before a collective moves data, the ranks exchange a small header
//    describing it (operation, dtype, element count, reduction, root; with
//    Consistency::kFingerprint also the shape). Ranks that disagree all throw
//    dtrain::DesyncError from Work::wait(), naming both sides, before any data moved: never
//    an abort, a hang or wrong numbers. NCCL compares the same header (all-gathered on a
//    second NCCL communicator, docs/nccl.md) from world size 2 on when asked to
//    (CommunicatorOptions::nccl_call_check): there the exchange blocks the issuing thread.
//  * Thread safety: a communicator may be called from several threads. Taking the sequence
//    number and queueing the call are one atomic step, so on every rank the numbering is
//    the execution order. Which of two racing threads goes first is up to the scheduler,
//    however, and may differ between ranks: racing calls that differ are refused with
//    DesyncError, racing calls that look alike (same op, dtype, size) may be paired with
//    each other's data. Issue collectives from one thread, or order the threads yourself.
//  * Tensors must be dense and contiguous, on the communicator's device (device(): CPU for
//    Gloo unless CommunicatorOptions::device says otherwise, the rank's CUDA device for
//    NCCL). Violations throw dtrain::InvalidArgument synchronously.
//  * Every call is bounded by a timeout (CommunicatorOptions::timeout unless the call's
//    options override it). A timeout or a transport failure throws from Work::wait() and
//    breaks the communicator: every later call fails with the first error as cause.
//  * No Gloo, NCCL or CUDA type appears here; backends are chosen by make_communicator.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/store.h"
#include "dtrain/work.h"

namespace dtrain {

enum class ReduceOp { kSum, kAvg, kMin, kMax };

enum class Backend {
  // CPU tensors over Gloo's TCP pairs or shared memory (Transport).
  kGloo,
  // CUDA tensors over NCCL.
  kNccl,
  // CPU tensors over the job's MPI (Open MPI, MPICH): for clusters whose fast network MPI
  // reaches (UCX, verbs), and for applications that hold an MPI_Comm (dtrain/mpi.h). Ranks
  // must be processes of one MPI job (mpirun, srun --mpi=pmix); dtrain initializes MPI when
  // nothing has, and finalizes what it initialized at exit. docs/communication.md, "MPI".
  kMpi,
};

// Who moves the MPI backend's calls on (docs/communication.md, "MPI"). dtrain never needs
// MPI_THREAD_MULTIPLE; every MPI call it makes is serialized by one lock per process.
enum class MpiProgress {
  // kThread where MPI allows it (MPI_THREAD_MULTIPLE, or MPI initialized by dtrain), else
  // kCaller.
  kAuto,
  // A dtrain thread starts and completes calls in the background, so they overlap compute as
  // with Gloo. make_communicator throws InvalidArgument where MPI does not allow it.
  kThread,
  // Calls advance only on the threads that call dtrain: when issued, and inside Work::wait()
  // and Work::is_completed(). Works at every thread level; the application must not call MPI
  // while another of its threads is inside dtrain (below MPI_THREAD_MULTIPLE), and at
  // MPI_THREAD_FUNNELED calls dtrain from the main thread only.
  kCaller,
};

// How the Gloo (CPU) backend moves collectives' data (docs/communication.md, "Shared memory").
enum class Transport {
  // Shared memory when every rank runs on one host (same kernel, /dev/shm and namespaces);
  // across hosts with the same number of ranks (two or more) each, shared memory inside
  // hosts and Gloo between them; else Gloo's TCP pairs. DTRAIN_TRANSPORT=auto|gloo|shm sets
  // it through LaunchInfo.
  kAuto,
  // Gloo's TCP pairs, also between ranks of one host.
  kGloo,
  // POSIX shared memory (hierarchical across hosts, also with one rank per host);
  // make_communicator throws InvalidArgument when hosts hold different numbers of ranks,
  // CommError when no segment can be created.
  kSharedMemory,
};

// What ranks compare before every collective (see the contract above). Both levels cost one
// header message to every peer per collective; kFingerprint compares more of it.
enum class Consistency {
  // Operation, dtype, element count, reduction and root: everything whose mismatch would
  // abort, hang or silently corrupt the result. Always on for Gloo, shared memory and MPI; on
  // NCCL with CommunicatorOptions::nccl_call_check.
  kCheap,
  // Also the full shape ([2, 512] and [1024] differ), to find where ranks' programs diverge.
  // DTRAIN_COLLECTIVE_CHECK=fingerprint turns it on through LaunchInfo.
  kFingerprint,
};

const char* to_string(ReduceOp op);
const char* to_string(Backend backend);
const char* to_string(Consistency consistency);
const char* to_string(Transport transport);   // "auto", "gloo", "shared_memory"
const char* to_string(MpiProgress progress);  // "auto", "thread", "caller"

// Per-call options.
struct CallOptions {
  // Bound on this call; a non-positive value means the communicator's default.
  std::chrono::milliseconds timeout{-1};
};

struct CommunicatorOptions {
  Backend backend = Backend::kGloo;
  // Bound on connecting and on each call.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // Gloo: network interface whose address this rank listens on, e.g. "eth0" (what
  // GLOO_SOCKET_IFNAME sets through LaunchInfo::communicator_options). Set it when hosts have
  // several interfaces and the one that routes to the master is not the fast one. An
  // interface that does not exist or has no address throws InvalidArgument naming those
  // that do.
  std::string interface;
  // Gloo: address (or name) this rank listens on; ignored when `interface` is set.
  // Both empty: the address of the interface that routes to the store's server, i.e. to
  // MASTER_ADDR (Store::network_address): loopback only when the master is loopback;
  // 127.0.0.1 for in-process stores.
  std::string hostname;
  // Gloo backend: the data path of collectives. Ranks must not ask for kGloo and
  // kSharedMemory at once (InvalidArgument); kAuto follows the others. Point-to-point calls
  // always go through Gloo's TCP pairs.
  Transport transport = Transport::kAuto;
  // Shared memory: bytes of one rank's buffer in each of the segment's two buffer sets (the
  // segment holds 2 * world_size of them). Calls move data in chunks of this size, one or
  // two barriers per chunk. Rank 0's value applies to all.
  size_t shm_chunk_bytes = 1u << 20;
  // Gloo: largest message piece the ring collectives (all_reduce, reduce_scatter) move at
  // once. reduce_scatter reduces one segment while the next ones are in flight, so smaller
  // segments overlap more of the reduction with the transfer, at a per-message cost.
  size_t gloo_max_segment_bytes = 4u << 20;
  // NCCL: the CUDA device this rank uses. -1: the current device, except through
  // LaunchInfo::communicator_options / init_communicator, which apply the device contract
  // (LaunchInfo::cuda_device: LOCAL_RANK, or 0 when CUDA_VISIBLE_DEVICES shows one device).
  int device_index = -1;
  // Gloo (every transport): the device whose tensors the communicator accepts. CPU, the
  // default: Gloo moves the tensors' own memory. Another device (e.g. cuda:0, which several
  // ranks may share): each call stages its tensors through host memory: a copy to the host
  // on the caller's thread (on CUDA into pinned memory, ordered after the caller's current
  // stream and synchronized before Gloo reads it), the collective on the host, and the
  // result copied back to the device when Work::wait() returns (on CUDA on the waiting
  // thread's current stream). A device LibTorch cannot allocate on throws InvalidArgument.
  // NCCL ignores it (device_index chooses). MPI stages the same way.
  c10::Device device = c10::Device(c10::kCPU);
  // MPI: who moves calls on (MpiProgress).
  MpiProgress mpi_progress = MpiProgress::kAuto;
  // Key prefix in the store; two communicators on one store need different names.
  std::string name = "default";
  // How much of each collective ranks compare before moving data. Ranks may differ: the
  // strictest level any of them asks for applies to all.
  Consistency consistency = Consistency::kCheap;
  // NCCL: compare every collective's header (at `consistency`) before it runs, over a second
  // NCCL communicator. The issuing thread then waits for the header round trip of every call
  // (not for earlier kernels), which keeps it from running far ahead of the GPU; so it is a
  // debug setting, off by default as c10d's TORCH_DISTRIBUTED_DEBUG=DETAIL (a mismatch is
  // then caught by the timeout, not named). Consistency::kFingerprint turns it on too, and
  // DTRAIN_COLLECTIVE_CHECK (cheap or fingerprint) through LaunchInfo. Rank 0's choice
  // applies to every rank.
  bool nccl_call_check = false;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Backend backend() const = 0;
  // The data path collectives take: "gloo", "shared_memory", "hierarchical" (shared memory
  // inside hosts, Gloo between), "nccl" or "mpi".
  virtual const char* transport_name() const = 0;
  // The device whose tensors this communicator accepts (see the contract above): CPU for
  // Gloo unless configured otherwise (CommunicatorOptions::device), the rank's CUDA device
  // for NCCL. Exchanges that are not gradients or parameters (agreements, flags, metrics)
  // put their tensors here too, so that one communicator carries every exchange.
  virtual c10::Device device() const = 0;

  // Replaces `tensor` on every rank by the element-wise reduction over ranks.
  // kAvg requires a floating dtype.
  virtual WorkPtr all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::kSum,
                             const CallOptions& options = {}) = 0;

  // Copies `tensor` of rank `root` into `tensor` of every other rank.
  virtual WorkPtr broadcast(at::Tensor tensor, int root, const CallOptions& options = {}) = 0;

  // output (flat, numel == world_size * input.numel()) receives every rank's input in rank
  // order: rank r's input lands at [r * n, (r + 1) * n).
  virtual WorkPtr all_gather(at::Tensor output, at::Tensor input,
                             const CallOptions& options = {}) = 0;

  // input (flat, numel == world_size * output.numel()) is reduced over ranks; rank r
  // receives the slice [r * n, (r + 1) * n) of the result in `output`. `input` is not
  // modified. Sizes not divisible by the world size: pad with padded_size() (below).
  virtual WorkPtr reduce_scatter(at::Tensor output, at::Tensor input, ReduceOp op = ReduceOp::kSum,
                                 const CallOptions& options = {}) = 0;

  // Completes once every rank has called it.
  virtual WorkPtr barrier(const CallOptions& options = {}) = 0;

  // Point to point. A send matches the recv of the peer with the same tag; messages
  // between a pair with the same tag arrive in order. NCCL has no tags: its backend accepts
  // only tag 0 (InvalidArgument otherwise) and matches a pair's calls in issue order. Ranks may
  // issue different numbers of these, so they are numbered apart from collectives (their Work's
  // sequence number counts point-to-point calls only) and never shift collectives' numbering.
  virtual WorkPtr send(at::Tensor tensor, int dst, uint32_t tag = 0,
                       const CallOptions& options = {}) = 0;
  virtual WorkPtr recv(at::Tensor tensor, int src, uint32_t tag = 0,
                       const CallOptions& options = {}) = 0;

  // Number of collectives issued so far (the next one gets this sequence number).
  virtual uint64_t sequence_number() const = 0;

  // Blocking conveniences: issue and wait.
  void all_reduce_sync(at::Tensor t, ReduceOp op = ReduceOp::kSum) { all_reduce(t, op)->wait(); }
  void broadcast_sync(at::Tensor t, int root) { broadcast(t, root)->wait(); }
  void all_gather_sync(at::Tensor out, at::Tensor in) { all_gather(out, in)->wait(); }
  void reduce_scatter_sync(at::Tensor out, at::Tensor in, ReduceOp op = ReduceOp::kSum) {
    reduce_scatter(out, in, op)->wait();
  }
  void barrier_sync() { barrier()->wait(); }
};

using CommunicatorPtr = std::shared_ptr<Communicator>;

// Connects `world_size` ranks through `store`; every rank calls this with the same
// options.name. Blocks until all ranks joined; throws dtrain::TimeoutError if some rank
// did not join within options.timeout, dtrain::InvalidArgument for a backend that was
// not compiled in (see is_backend_available).
CommunicatorPtr make_communicator(std::shared_ptr<Store> store, int rank, int world_size,
                                  const CommunicatorOptions& options = {});

// Whether make_communicator can build this backend in this build.
bool is_backend_available(Backend backend);

// Smallest multiple of world_size that is >= numel: the flat length to allocate before
// all_gather / reduce_scatter of a length that does not divide evenly.
inline int64_t padded_size(int64_t numel, int world_size) {
  return (numel + world_size - 1) / world_size * world_size;
}

}  // namespace dtrain

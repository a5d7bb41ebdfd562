// Rendezvous: how a rank learns who it is and finds its peers.
//
// LaunchInfo::from_env() understands the launchers clusters use, in this order of
// precedence (the first convention whose variables are present wins; its variables must
// then be complete and consistent, else InvalidArgument names them):
//
//   1. torchrun / dtrain-run: RANK, WORLD_SIZE (both required), LOCAL_RANK,
//      LOCAL_WORLD_SIZE (default: RANK and WORLD_SIZE, i.e. one host).
//   2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE.
//   3. Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and ranks per host from
//      SLURM_STEP_TASKS_PER_NODE (e.g. "4(x2),2", indexed by SLURM_NODEID), else
//      SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE.
//   4. none: one process (rank 0 of 1).
//
// DTRAIN_COLLECTIVE_CHECK=fingerprint (or cheap, the default) sets the consistency check of
// every communicator the process creates through communicator_options (see Consistency).
//
// Where rank 0 serves the TCP store: MASTER_ADDR and MASTER_PORT under every convention.
// Defaults when unset: under Slurm, the first host of SLURM_STEP_NODELIST (else
// SLURM_JOB_NODELIST) and port 29500 + SLURM_JOB_ID % 1000 (jobs sharing a host differ);
// under Open MPI on one host, 127.0.0.1 (across hosts MASTER_ADDR is required: mpirun
// publishes no host list; pass it with `mpirun -x MASTER_ADDR=host0`); otherwise
// 127.0.0.1:29500. GLOO_SOCKET_IFNAME (as in PyTorch) names the interface ranks listen on.
// DTRAIN_TRANSPORT=auto|gloo|shm: the data path of CPU collectives (CommunicatorOptions::
// transport) where the program leaves it at kAuto.
// DTRAIN_STORE_TOKEN (optional, at most 1024 bytes): a secret shared by the job's processes;
// the store refuses a process that does not present it (TcpStoreOptions::token).
// DTRAIN_RDZV_BACKEND (dtrain-run's --rdzv_backend, torchrun's name): where the job's store
// lives. c10d (also static or tcp; the default): the TCP store rank 0 serves at
// MASTER_ADDR:MASTER_PORT, which ends with rank 0's host. etcd: an external etcd server at
// DTRAIN_RDZV_ENDPOINT (host:port[,host:port...], required then), which survives the loss of
// any host; keys live under /dtrain/<TORCHELASTIC_RUN_ID>/<DTRAIN_GENERATION>/ (run id
// "none" and generation 0 when unset), and MASTER_ADDR, MASTER_PORT and DTRAIN_STORE_TOKEN
// play no part in it.
// DTRAIN_JOIN_TIMEOUT (seconds, e.g. 60 or 2.5; dtrain-run's --join_timeout_s): how long a rank
// waits for the master and for every rank to join (LaunchInfo::join_timeout, connect_store).
// CUDA_VISIBLE_DEVICES is read for the device contract (LaunchInfo::cuda_device).
// LaunchInfo::from_env() is the only place dtrain reads these variables.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "dtrain/communicator.h"
#include "dtrain/store.h"

namespace dtrain {

// Where the job's store lives (DTRAIN_RDZV_BACKEND).
enum class RendezvousBackend { kTcp, kEtcd };
const char* to_string(RendezvousBackend backend);

// The launcher convention LaunchInfo::from_env found.
enum class LaunchSource { kNone, kTorchrun, kOpenMpi, kSlurm };
const char* to_string(LaunchSource source);

struct LaunchInfo {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // Interface every communicator of this process listens on (GLOO_SOCKET_IFNAME); empty:
  // the one that routes to master_addr (see CommunicatorOptions::interface).
  std::string socket_interface;
  // DTRAIN_STORE_TOKEN: the job token connect_store presents to (on rank 0: requires of) the
  // store's clients; empty: none.
  std::string store_token;
  LaunchSource source = LaunchSource::kNone;
  // DTRAIN_RDZV_BACKEND, DTRAIN_RDZV_ENDPOINT: connect_store uses the TCP store of rank 0, or
  // the etcd server at rdzv_endpoint (kEtcd requires it).
  RendezvousBackend rdzv_backend = RendezvousBackend::kTcp;
  std::string rdzv_endpoint;
  // TORCHELASTIC_RUN_ID (dtrain-run's --rdzv_id) and DTRAIN_GENERATION: the etcd keys of this
  // job and generation live under /dtrain/<run_id>/<generation>/, so runs and restarts that
  // share one etcd never see each other's keys.
  std::string run_id = "none";
  int generation = 0;
  // DTRAIN_COLLECTIVE_CHECK: communicator_options raises CommunicatorOptions::consistency to
  // this level, never lowers it.
  Consistency consistency = Consistency::kCheap;
  // DTRAIN_COLLECTIVE_CHECK set (to either level): communicator_options turns on
  // CommunicatorOptions::nccl_call_check.
  bool collective_check = false;
  // DTRAIN_TRANSPORT: communicator_options sets CommunicatorOptions::transport to this where
  // the caller left it at kAuto.
  Transport transport = Transport::kAuto;
  // DTRAIN_JOIN_TIMEOUT: when set, connect_store and init_communicator wait this long for the
  // master and for every rank, whatever timeout the program passes (an operator's setting
  // wins over the code's). nullopt: the program's timeout (300 s unless it says otherwise).
  std::optional<std::chrono::milliseconds> join_timeout;
  // CUDA_VISIBLE_DEVICES as this process got it; nullopt when unset. Only the number of
  // devices it lists matters to dtrain (cuda_device).
  std::optional<std::string> cuda_visible_devices;

  // Reads this process's environment by the rules above. Throws dtrain::InvalidArgument
  // naming the variable when one is malformed, missing from an otherwise present
  // convention, or inconsistent (a rank outside its world, ...).
  static LaunchInfo from_env();
  // The same rules applied to `env` (for tests and for programs that hold the variables).
  static LaunchInfo from_env(const std::map<std::string, std::string>& env);

  // Throws dtrain::InvalidArgument when the fields are inconsistent.
  void validate() const;

  // Whether CUDA_VISIBLE_DEVICES lists exactly one device: a launcher or scheduler gave this
  // rank a GPU of its own (e.g. Slurm's --gpus-per-task with --gpu-bind), which the process
  // then sees as device 0.
  bool narrowed_to_one_gpu() const;

  // The device contract: which CUDA device this rank uses, out of the `device_count` devices
  // the process sees (cuda_device_count()). One rule for the trainer, init_communicator and
  // every launcher (docs/nccl.md, "Which GPU a rank uses"):
  //   - device 0 when CUDA_VISIBLE_DEVICES narrows the process to one device;
  //   - else device LOCAL_RANK.
  // NCCL cannot run two ranks on one GPU: for Backend::kNccl, a host with more ranks
  // (LOCAL_WORLD_SIZE) than visible devices is refused on every rank, before NCCL is called,
  // with an InvalidArgument naming both counts and what to change. Backend::kGloo stages CUDA
  // tensors through host memory, so ranks may share a GPU: local rank r uses device
  // r % device_count. Throws InvalidArgument when device_count < 1. Two ranks narrowed to the
  // same physical GPU cannot be seen from one process: the NCCL backend compares the GPUs'
  // UUIDs across ranks before creating its communicator (make_communicator).
  int cuda_device(int device_count, Backend backend) const;

  // `options` with what this launch decides filled in where the caller left it unset: the
  // listening interface (socket_interface) and, for NCCL, the device (cuda_device with
  // cuda_device_count(); throws its InvalidArgument); and the consistency level raised to
  // `consistency`; the transport, if left at kAuto.
  CommunicatorOptions communicator_options(CommunicatorOptions options = {}) const;
};

// The number of CUDA devices this process sees through LibTorch: 0 without a GPU or with a
// LibTorch built without CUDA.
int cuda_device_count();

// Connects to (on rank 0: serves) the TCP store at master_addr:master_port, or with
// rdzv_backend kEtcd connects every rank to the etcd server at rdzv_endpoint, then checks
// that the job is launched consistently: every rank of [0, world_size) is claimed by
// exactly one process, and all agree on world_size. Otherwise every rank throws
// dtrain::InvalidArgument naming both sides (e.g. two hosts with the same --node_rank, or
// hosts started with different --nnodes / --nproc_per_node, or an etcd still holding an
// earlier run with the same run id and generation). An unreachable master or etcd throws
// dtrain::TimeoutError after the join timeout; a port already taken on the master throws
// dtrain::CommError on rank 0.
// The join timeout is info.join_timeout (DTRAIN_JOIN_TIMEOUT) when set, else `timeout`, else
// 300 s. While it waits, a rank says so on stderr every 30 s (every tenth of the join timeout
// when that is shorter, at least every second), e.g.
//   dtrain: rank 1 of 2 waiting for the master at 10.0.0.1:29500, 30 s of 300 s ...
//   dtrain: rank 0 of 2 waiting for 1 of 2 ranks (rank 1) at 10.0.0.1:29500, 30 s of 300 s ...
std::shared_ptr<Store> connect_store(const LaunchInfo& info,
                                     std::optional<std::chrono::milliseconds> timeout = {});

// connect_store (with options.timeout as the program's join timeout) +
// make_communicator(info.communicator_options(options)): the usual first line of a
// distributed program. A world of size 1 needs no store and never touches the
// network.
CommunicatorPtr init_communicator(const LaunchInfo& info, const CommunicatorOptions& options = {});

}  // namespace dtrain

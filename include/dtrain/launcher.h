// Starting the ranks of one node as processes and supervising them: what dtrain-run does,
// for programs that start their own ranks, as torch.multiprocessing.spawn does for Python
// (gpt2_train --nproc, the benchmarks):
//
// clang-format off
//   if (std::getenv("RANK") == nullptr && nproc > 1) {  // not started by a launcher
//     dtrain::launcher::NodeOptions node;
//     node.argv = dtrain::launcher::self_command(argc, argv);
//     node.nproc_per_node = nproc;
//     return dtrain::launcher::run_node(node);  // runs this program once per rank
//   }
//   auto comm = dtrain::init_communicator(dtrain::LaunchInfo::from_env());
// clang-format on
//
// Plain POSIX, no LibTorch: every rank runs under its own supervisor, dtrain-supervise (a
// small program built and installed with dtrain-run), started with fork and an immediate
// exec; between the two the child makes only async-signal-safe system calls (process group,
// parent-death signal, signal mask, redirections). Calling it after LibTorch ran is
// therefore safe: nothing in the child touches OpenMP or a lock another thread may hold.
//
// Failure model of run_node() (docs/reliability.md, "The launcher"):
// - no process of a rank's tree outlives the launcher, however the launcher ends (SIGKILL
//   included) and however the process got there (a wrapper script's children, a daemon
//   that double-forked into a session of its own): the supervisor is a child subreaper, so
//   every orphan of the tree is reparented to it, and it kills the whole tree when the rank
//   ends, when asked, and when the launcher dies (its parent-death signal);
// - every rank is the leader of its own process group; SIGINT and SIGTERM are forwarded to
//   it, SIGHUP and SIGQUIT are handled like SIGTERM (SIGTERM goes to the ranks); a second
//   signal, or `grace` after the first, SIGKILLs every rank's whole tree;
// - when a rank fails, the other ranks are stopped and the failure decides the exit status;
// - when a rank ends, whatever is left of its tree is SIGKILLed.
#pragma once

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace dtrain::launcher {

struct NodeOptions {
  // The command each rank runs: argv[0] is looked up in PATH unless it contains a '/'.
  std::vector<std::string> argv;
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;  // this node's index in [0, nnodes)
  std::string master_addr = "127.0.0.1";
  // Where rank 0 serves the store. 0 picks a free local port, which only works for a
  // single node (other nodes could not know it).
  int master_port = 0;
  // When stopping the ranks (a rank failed, or a signal arrived): how long their process
  // groups get between SIGTERM and SIGKILL.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  // When a rank fails (not when a signal stops the job): how many times every rank of this
  // node is stopped and started again, as torchrun's --max_restarts. Only with nnodes 1:
  // restarting several nodes together needs the elastic rendezvous, not built yet.
  int max_restarts = 0;
  // Prefix of the messages printed on stderr.
  std::string name = "dtrain-run";
  // The per-rank supervisor program; empty: dtrain-supervise next to this program's
  // executable, else in the bin directory dtrain was installed to, else in dtrain's build
  // tree.
  std::string supervisor;
  // Variables added to every rank's environment (e.g. the OPENBLAS_CORETYPE a
  // dtrain::BlasKernelPlan selects, or OMP_NUM_THREADS); they replace the launcher's own
  // values, and the rank variables below take precedence over them.
  std::map<std::string, std::string> environment;
};

// Throws std::invalid_argument naming the bad option.
void validate(const NodeOptions& options);

// Runs this node's ranks and waits for them. Rank r (local rank l) gets this process's
// environment plus `environment` and RANK=node_rank*nproc_per_node+l,
// WORLD_SIZE=nnodes*nproc_per_node, LOCAL_RANK=l, LOCAL_WORLD_SIZE=nproc_per_node,
// MASTER_ADDR and MASTER_PORT (CUDA_VISIBLE_DEVICES is left as it is: a rank picks its GPU
// by the device contract, LaunchInfo::cuda_device in dtrain/rendezvous.h). Each rank leads
// its own process group under its supervisor, and its whole tree is killed when the calling
// thread ends (PR_SET_PDEATHSIG is tied to the thread that forked): call it from the thread
// that lives as long as the job, normally the main thread. When stdin is a terminal
// the ranks read /dev/null instead (outside the terminal's foreground group, a read would
// stop them).
//
// Signals received meanwhile: SIGINT and SIGTERM are forwarded to the ranks' groups,
// SIGHUP and SIGQUIT send SIGTERM to them (a SIGHUP ignored when run_node starts, as under
// nohup, stays ignored); a second signal kills their trees. The handlers are this process's only
// while run_node runs; the previous ones are restored when it returns. When a rank fails
// (non-zero exit or a signal), prints which rank failed and how and sends SIGTERM to the
// other ranks' groups. Ranks still running `grace` after a SIGTERM have their whole trees
// SIGKILLed; a rank's tree is also killed as soon as the rank ends. SIGCHLD
// is at its default meanwhile (ignored, the kernel would reap the ranks and lose their
// statuses). A waitpid() result other than the rank's own status (e.g. ECHILD: someone
// else reaped it) counts as a failure of that rank.
//
// Restarts (max_restarts > 0): when a rank fails, the others are stopped as above, and once
// every tree is gone all ranks start again, with a new MASTER_PORT when it was picked
// here. Every rank gets TORCHELASTIC_RESTART_COUNT (0 at first), TORCHELASTIC_MAX_RESTARTS
// and DTRAIN_GENERATION (on one node, the restart count). A program that resumes from its
// newest checkpoint (gpt2_train --ckpt_dir D --resume) continues from there. A stop signal
// is never followed by a restart.
//
// Returns the status to exit with: 0 when every rank exited 0; else the failed rank's exit
// code (of the last generation), or 128 + signal number when it was killed by a signal or a signal
// stopped the job (129 SIGHUP, 130 SIGINT, 131 SIGQUIT, 143 SIGTERM); 1 for a waitpid failure.
// Throws std::invalid_argument for bad options (see validate) and std::runtime_error when the
// supervisor cannot be found (the message names the places tried) or a rank cannot be
// started (the ones already started are killed first).
int run_node(const NodeOptions& options);

// The command that starts this program again with the same arguments, for
// NodeOptions::argv: the executable /proc/self/exe points to (so that neither a relative
// argv[0] nor PATH can pick another program; argv[0] if it cannot be read) and argv[1..].
std::vector<std::string> self_command(int argc, char** argv);

// This process's environment as KEY=VALUE strings, without the names in `remove`, with
// `overrides` set: the environment of a program this process starts (exec, spawn).
std::vector<std::string> environment_with(const std::map<std::string, std::string>& overrides,
                                          const std::set<std::string>& remove = {});

}  // namespace dtrain::launcher

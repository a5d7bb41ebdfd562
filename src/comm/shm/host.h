// What the shared-memory transport needs to know about hosts and processes: whether ranks
// can share memory at all (same kernel, same /dev/shm, same IPC and PID namespaces), and
// whether a peer process still runs (a dead peer must fail a wait, not leave it spinning).
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::shm {

// "hostname boot=<boot id> shm=<device of /dev/shm> ipc=<ns> pid=<ns> net=<ns>": equal
// strings mean the two processes can map one segment and check each other's pid. The
// hostname alone is not enough: containers share names, and one name may hide two kernels.
// The network namespace is part of it because a process with its own network is set up as a
// host of its own (pods, the veth two-host test), even where it could share memory.
std::string host_identity();

// The hostname alone, for messages.
std::string host_name();

// A process, with its start time so that a reused pid is not mistaken for the peer.
struct ProcessId {
  int32_t pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22; 0: unknown
};

ProcessId this_process();

// False once `p` exited, was killed (a zombie counts as dead: its parent may reap it
// late), or its pid now names another process.
bool process_alive(const ProcessId& p);

}  // namespace dtrain::shm

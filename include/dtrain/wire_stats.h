// Bytes on the wire: the payload bytes a rank sent through a communicator, by collective kind
// and by whether the receiving rank runs on this rank's host. Counted where the transport
// sends, never estimated from tensor sizes: what is counted per algorithm is defined in
// docs/communication.md ("Bytes on the wire").
#pragma once

#include <cstdint>

namespace dtrain {

class Communicator;

struct WireBytes {
  // To ranks on this rank's host: Gloo's TCP pairs over loopback, or bytes written into the
  // shared-memory segment for the host's other ranks.
  uint64_t intra_host = 0;
  // To ranks on other hosts (host identity as the shared-memory transport defines it: same
  // kernel, /dev/shm and namespaces; docs/communication.md).
  uint64_t inter_host = 0;

  uint64_t total() const { return intra_host + inter_host; }
  WireBytes& operator+=(const WireBytes& o) {
    intra_host += o.intra_host;
    inter_host += o.inter_host;
    return *this;
  }
  WireBytes& operator-=(const WireBytes& o) {
    intra_host -= o.intra_host;
    inter_host -= o.inter_host;
    return *this;
  }
};

struct WireStats {
  // False where the data path does not count (NCCL, whose algorithms are chosen inside
  // NCCL; a single-device strategy): every count is then 0 and means "unknown".
  bool counted = false;
  // Per kind of the user's call: a hierarchical all-reduce's shared-memory and leader steps
  // all count as all_reduce.
  WireBytes all_reduce, broadcast, all_gather, reduce_scatter;
  WireBytes point_to_point;  // send() payloads (recv() sends nothing)
  // The consistency headers ranks exchange before each collective (barriers included).
  WireBytes control;

  // Every kind summed.
  WireBytes total() const {
    WireBytes t = all_reduce;
    t += broadcast;
    t += all_gather;
    t += reduce_scatter;
    t += point_to_point;
    t += control;
    return t;
  }
  // What was sent between two readings of wire_stats() (`earlier` first).
  WireStats since(const WireStats& earlier) const {
    WireStats d = *this;
    d.all_reduce -= earlier.all_reduce;
    d.broadcast -= earlier.broadcast;
    d.all_gather -= earlier.all_gather;
    d.reduce_scatter -= earlier.reduce_scatter;
    d.point_to_point -= earlier.point_to_point;
    d.control -= earlier.control;
    return d;
  }
  // Adds `o`'s counts (micro-batches of one step); counted if either was.
  WireStats& operator+=(const WireStats& o) {
    counted = counted || o.counted;
    all_reduce += o.all_reduce;
    broadcast += o.broadcast;
    all_gather += o.all_gather;
    reduce_scatter += o.reduce_scatter;
    point_to_point += o.point_to_point;
    control += o.control;
    return *this;
  }
};

// Payload bytes `comm`'s rank has sent through it since it was made, per collective kind, to
// ranks on its host and on other hosts. Calls still running may be partly counted: read it
// after waiting for them, and take the difference of two readings (WireStats::since) for a
// step. counted is false where the backend does not count (NCCL) and for a Communicator not
// made by make_communicator (a test double). Thread-safe; costs a few atomic loads.
WireStats wire_stats(const Communicator& comm);

}  // namespace dtrain

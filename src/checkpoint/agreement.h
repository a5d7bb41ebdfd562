// The ranks of a checkpoint save or load, over the strategy's communicator (none for one
// rank), and how they agree: a step that fails on any rank fails on every rank.
#pragma once

#include <cstdint>
#include <exception>

#include "comm/control_plane.h"
#include "dtrain/communicator.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint {

struct Ranks {
  Communicator* comm = nullptr;
  int rank = 0, world = 1;

  explicit Ranks(const CommunicatorPtr& c) : comm(c.get()) {
    if (comm != nullptr) {
      rank = comm->rank();
      world = comm->world_size();
    }
  }
  bool many() const { return world > 1; }
  // Where the communicator takes tensors (the CPU without one).
  c10::Device device() const { return comm != nullptr ? comm->device() : c10::Device(c10::kCPU); }
  ErrorContext ctx(const char* op) const { return ErrorContext{rank, world, op, -1}; }

  // Runs fn on every rank; if it failed anywhere, every rank throws (the local error where
  // there is one), so that no rank goes on to a step the others will not take.
  template <typename Fn>
  void agreed(const char* what, Fn&& fn) const {
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    if (many()) {
      const int64_t failed =
          ControlPlane(*comm).all_reduce_value(error ? int64_t{1} : int64_t{0}, ReduceOp::kMax);
      if (!error && failed != 0) {
        throw CheckpointError(ctx(what), "another rank failed (see its error)");
      }
    }
    if (error) std::rethrow_exception(error);
  }
};

}  // namespace dtrain::checkpoint

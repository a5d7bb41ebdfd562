// dtrain's exception hierarchy.
//
// Every failure the library reports is a dtrain::Error. Communication errors carry the
// rank, the world size, the operation and the collective's sequence number, so that a
// log line from any rank says which collective failed and why. Library code never calls
// exit() or abort().
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dtrain {

// Where an error happened. Fields that do not apply are -1 / empty.
struct ErrorContext {
  int rank = -1;
  int world_size = -1;
  std::string op;         // e.g. "all_reduce", "store.get", "DataParallel()"
  int64_t sequence = -1;  // per-communicator collective sequence number
};

// Base of every exception thrown by dtrain. what() is the full, formatted message;
// cause() is the underlying reason alone.
class Error : public std::runtime_error {
 public:
  Error(const ErrorContext& context, const std::string& cause);
  explicit Error(const std::string& cause) : Error(ErrorContext{}, cause) {}

  const ErrorContext& context() const noexcept { return context_; }
  const std::string& cause() const noexcept { return cause_; }

 private:
  ErrorContext context_;
  std::string cause_;
};

// A caller passed something invalid (wrong shape, dtype, rank, mismatched model...).
// Retrying with the same arguments fails the same way.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A transport or peer failure: a connection closed, a peer died, NCCL reported an
// error. The communicator that saw it is broken: every later call fails too.
class CommError : public Error {
 public:
  using Error::Error;
};

// A blocking call did not finish within its timeout (a peer is slow, hung, or never
// joined). Also sticky on the communicator that saw it.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// Ranks issued different collectives at the same sequence number (another operation, size,
// dtype, reduction or root; in fingerprint mode also another shape). Raised on every rank,
// before any data moved, naming both sides, e.g. "rank 0 issued all_reduce #17
// float32[1024] sum; rank 1 issued all_reduce #17 float32[512] sum". A program bug, not a
// transport failure, but it breaks the communicator like one: ranks no longer agree on
// which call comes next.
class DesyncError : public CommError {
 public:
  using CommError::CommError;
};

// A training step failed on another rank (its exception in forward, backward or a
// communication hook). Every rank throws from the same step, this one with this error naming
// the failing rank and its message; the step's gradients were dropped (zeroed) and the
// strategy is ready for the next step (docs/strategies.md, "Failures").
class StepError : public Error {
 public:
  using Error::Error;
};

// A checkpoint or safetensors file cannot be used: missing, truncated, corrupted (checksum),
// foreign (not written by dtrain / not safetensors), or not matching what loads it (other
// model, format version, strategy state). The message is one line naming the file and the
// problem. Nothing was loaded into the caller's model when it is thrown during validation.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

}  // namespace dtrain

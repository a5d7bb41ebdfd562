// PowerSGD: low-rank gradient compression for DataParallel (Vogels et al., "PowerSGD:
// Practical Low-Rank Gradient Compression for Distributed Optimization", and PyTorch's
// powerSGD_hook, whose semantics this follows).
//
// Each gradient of a bucket that is a matrix (a parameter of 2 or more dimensions, seen as
// shape[0] x the rest) and worth compressing is sent as two thin factors instead of itself:
//
//   P = M Q           (n x r)   all-reduced (sum), then orthonormalised (QR, fp32)
//   Q = M^T P         (m x r)   all-reduced (sum)
//   M ~ P Q^T / world            the averaged gradient this rank's optimizer sees
//
// so an n x m gradient costs (n + m) * r elements on the wire instead of n * m. Vectors
// (biases, norms' weights) and matrices too small to gain are all-reduced as they are, in one
// collective with the P factors of the bucket. A bucket thus costs two all-reduces.
//
// clang-format off
//   dtrain::PowerSgdOptions o;
//   o.rank = 2;
//   dtrain::DataParallelOptions ddp;
//   ddp.comm_hook = dtrain::powersgd_hook(o);
// clang-format on
//
// One hook belongs to one DataParallel (it keeps per-bucket state) and must be built with
// the same options on every rank.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm_hook.h"

namespace dtrain {

struct PowerSgdOptions {
  // The rank r of the approximation (PyTorch's matrix_approximation_rank); 1 to 4 is typical.
  // A matrix with fewer rows or columns than r uses min(rows, columns).
  int rank = 1;
  // Synced steps (backward() calls that communicate) reduced by a plain all-reduce average
  // before compression starts: early training is sensitive to gradient error. Must be >= 2
  // with error_feedback or warm_start, because DataParallel rebuilds its buckets after the
  // first step and the per-bucket state must be made for the final buckets.
  int64_t start_iter = 10;
  // A matrix is compressed only when n * m > min_compression_rate * (n + m) * r, i.e. when
  // it shrinks by more than this factor; others are all-reduced as they are. 0 compresses
  // every matrix (also at r = min(n, m), where nothing is saved: used to test the algorithm).
  double min_compression_rate = 2.0;
  // Add the previous step's compression error (what this rank's input lost) to this step's
  // gradient before compressing, so that no gradient is lost for good, only delayed.
  bool error_feedback = true;
  // Start each step's power iteration from the previous step's Q (one iteration per step
  // then converges over steps); without it Q is drawn anew every step. A column of Q that
  // became zero (its matrix had a zero gradient, e.g. a layer unused in a step) is drawn
  // anew, or that matrix's updates would stay zero.
  bool warm_start = true;
  // Seed of the random initial Q (the same on every rank, as it must be). The draw for a
  // bucket depends on (seed, step, bucket) only, so a resumed run draws the same Q.
  uint64_t seed = 0;
};

// The hook (see above). state() / load_state() carry what a resumed run needs to continue
// exactly: the step counter, each bucket's error-feedback buffer and Q.
class PowerSgdHook final : public CommHook {
 public:
  // Throws InvalidArgument for rank < 1, start_iter < 0 (or < 2 with error feedback or warm
  // start) or a negative min_compression_rate.
  explicit PowerSgdHook(PowerSgdOptions options);
  ~PowerSgdHook() override;

  WorkPtr run(Communicator& comm, GradBucket& bucket) override;
  std::string name() const override { return "powersgd"; }

  const PowerSgdOptions& options() const { return options_; }
  // Synced steps seen so far (the last bucket of a step counts it).
  int64_t iteration() const { return iteration_; }

  // Named tensors (CPU, contiguous copies) of the hook's state: "iteration" (int64, one
  // element), "bucket.<i>.error" (fp32, the bucket's length) and "bucket.<i>.q" (fp32, the
  // bucket's Q factors, each r x m, concatenated in parameter order). Call between steps.
  std::map<std::string, at::Tensor> state() const override;
  // Restores what state() returned (on a hook with the same options, before the first step).
  // A bucket whose layout later differs from the saved one throws InvalidArgument when it is
  // reduced, naming the bucket. Throws InvalidArgument for an unknown or malformed entry.
  void load_state(const std::map<std::string, at::Tensor>& state) override;

 private:
  struct Bucket;
  Bucket& bucket_state(const Communicator& comm, const GradBucket& bucket);

  PowerSgdOptions options_;
  int64_t iteration_ = 0;
  std::map<int, std::unique_ptr<Bucket>> buckets_;
};

std::shared_ptr<PowerSgdHook> powersgd_hook(PowerSgdOptions options = {});

}  // namespace dtrain

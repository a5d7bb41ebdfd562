// Communication hooks: how DataParallel turns a bucket of local gradients into the
// global-batch gradient.
//
// DataParallel groups gradients into flat buckets and calls the hook for each bucket as
// soon as its last gradient is ready, while backward continues. The hook issues
// communication and returns a Work; when that Work's wait() returns, bucket.buffer must
// hold the gradient averaged over ranks. Buckets are handed to the hook in the same order
// on every rank, and a hook must issue the same collectives on every rank.
//
// A user-written hook, e.g. averaging in fp64:
//
// clang-format off
//   class Fp64AverageHook : public dtrain::CommHook {
//    public:
//     dtrain::WorkPtr run(dtrain::Communicator& comm, dtrain::GradBucket& b) override {
//       at::Tensor wide = b.buffer.to(at::kDouble);
//       auto work = comm.all_reduce(wide, dtrain::ReduceOp::kAvg);
//       return dtrain::then(work, [b = b.buffer, wide] { b.copy_(wide); });
//     }
//     std::string name() const override { return "fp64_average"; }
//   };
// clang-format on
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/work.h"

namespace dtrain {

struct GradBucket {
  int index = 0;      // position in issue order, identical on every rank
  at::Tensor buffer;  // flat gradients of `parameters`, reduced in place
  std::vector<at::Tensor> parameters;
  std::vector<int64_t> offsets;  // element offset of each parameter's gradient in buffer
  bool is_last = false;          // the last bucket of this backward
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual WorkPtr run(Communicator& comm, GradBucket& bucket) = 0;
  virtual std::string name() const = 0;

  // State a resumed run needs to continue exactly (e.g. PowerSGD's error feedback), this
  // rank's, as named CPU tensors: checkpoints save it (StateLayout::rank_state) and hand it
  // back to load_state() when resuming at the same world size. Called between steps. The
  // defaults: a stateless hook, which has nothing to save and refuses state it did not write
  // (InvalidArgument naming the first entry).
  virtual std::map<std::string, at::Tensor> state() const { return {}; }
  virtual void load_state(const std::map<std::string, at::Tensor>& state);
  // Communicators the hook uses besides the one run() is given (e.g. a host group), so
  // that StepStats::wire counts their bytes too. Default: none.
  virtual std::vector<CommunicatorPtr> communicators() const { return {}; }
};

// All-reduce average in the gradient's dtype (the default).
std::shared_ptr<CommHook> allreduce_hook();
// Casts to fp16 / bf16, all-reduces (sum), divides by world size and casts back: half the
// bytes, at the price of rounding (bf16 keeps fp32's range, fp16 keeps more precision).
std::shared_ptr<CommHook> fp16_compress_hook();
std::shared_ptr<CommHook> bf16_compress_hook();
// Parameter-server style: every rank sends its bucket to `root`, which sums and averages
// and broadcasts the result. Traffic converges on one rank, as with a parameter server;
// kept as a baseline, not for speed.
std::shared_ptr<CommHook> parameter_server_hook(int root = 0);

}  // namespace dtrain

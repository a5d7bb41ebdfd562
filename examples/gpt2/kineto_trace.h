// A Kineto trace of a stretch of training (gpt2_train --trace_out): the Chrome trace JSON that
// Python's torch.profiler writes with export_chrome_trace(), from LibTorch's own profiler, so
// that one tool reads both sides (benchmarks/trace_table.py, scripts/gpu-check.sh `profile`).
//
//   KinetoTrace trace(path, /*cuda=*/true);  // throws here if this LibTorch cannot write one
//   trace.start();
//   ... the steps to trace ...
//   trace.stop();                             // writes `path`
//
// What it holds: every ATen operator and autograd node on the host (category "cpu_op"), and
// on CUDA the GPU's kernels, copies and memsets ("kernel", "gpu_memcpy", "gpu_memset") with
// the CUDA runtime calls that launched or waited for them ("cuda_runtime"), as CUPTI reports
// them. Unlike --profile_out (op_profile.h), which times operators on the host only, this is
// the device's timeline: kernel times, the GPU's idle gaps, host syncs.
//
// Needs a LibTorch built with Kineto (USE_KINETO: PyTorch's wheels and archives, Debian's
// 2.x packages; not Debian bookworm's 1.13): the constructor records and writes an empty
// trace to `path` to find out, so a run fails at its start, not after its training.
#pragma once

#include <cstddef>
#include <string>

namespace gpt2 {

class KinetoTrace {
 public:
  // Throws dtrain::Error naming the cause when this LibTorch has no Kineto or `path` cannot
  // be written.
  KinetoTrace(std::string path, bool cuda);
  ~KinetoTrace();
  KinetoTrace(const KinetoTrace&) = delete;
  KinetoTrace& operator=(const KinetoTrace&) = delete;

  // Starts recording (at most once).
  void start();
  // Stops recording and writes the trace; returns the number of events it holds. Throws
  // dtrain::Error when it cannot be written.
  std::size_t stop();
  bool recording() const { return recording_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool cuda_;
  bool recording_ = false;
  bool done_ = false;
};

}  // namespace gpt2

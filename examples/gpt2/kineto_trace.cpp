#include "kineto_trace.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "dtrain/errors.h"

namespace gpt2 {
namespace {

namespace impl = torch::profiler::impl;
namespace profiler = torch::autograd::profiler;

std::set<impl::ActivityType> activities(bool cuda) {
  std::set<impl::ActivityType> a{impl::ActivityType::CPU};
  if (cuda) a.insert(impl::ActivityType::CUDA);
  return a;
}

void enable(bool cuda) {
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  profiler::prepareProfiler(config, activities(cuda));
  profiler::enableProfiler(config, activities(cuda));
}

std::size_t disable_and_save(const std::string& path) {
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  // Kineto only logs a file it cannot open: see that the file is there afterwards.
  std::remove(path.c_str());
  try {
    result->save(path);
  } catch (const std::exception& e) {
    // LibTorch's message names USE_KINETO when that is the cause; keep only its first line.
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    throw dtrain::Error(
        fmt::format("--trace_out: cannot write a Kineto trace to {}: {}", path, why));
  }
  if (!std::ifstream(path).good()) {
    throw dtrain::Error(fmt::format("--trace_out: cannot write a Kineto trace to {}", path));
  }
  return result->events().size();
}

}  // namespace

KinetoTrace::KinetoTrace(std::string path, bool cuda) : path_(std::move(path)), cuda_(cuda) {
  // Probe: an empty trace, written where the real one will go.
  enable(cuda_);
  disable_and_save(path_);
}

KinetoTrace::~KinetoTrace() {
  if (!recording_) return;
  try {
    profiler::disableProfiler();  // an exception left the traced steps: record nothing more
  } catch (...) {
  }
}

void KinetoTrace::start() {
  if (recording_ || done_) throw dtrain::Error("KinetoTrace::start: already started");
  enable(cuda_);
  recording_ = true;
}

std::size_t KinetoTrace::stop() {
  if (!recording_) throw dtrain::Error("KinetoTrace::stop: not recording");
  recording_ = false;
  done_ = true;
  return disable_and_save(path_);
}

}  // namespace gpt2

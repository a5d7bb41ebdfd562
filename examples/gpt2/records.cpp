#include "records.h"

#include <algorithm>
#include <cmath>

#include "split_mix64.h"

namespace gpt2 {

double max_of(const std::vector<double>& values) {
  return values.empty() ? std::nan("") : *std::max_element(values.begin(), values.end());
}

int64_t sample_digest(int64_t sequence) {
  return static_cast<int64_t>(SplitMix64(static_cast<uint64_t>(sequence)).next() >> 32);
}

namespace {

// The kinds in the order wire_values lays them out.
std::vector<dtrain::WireBytes*> kinds(dtrain::WireStats& w) {
  return {&w.all_reduce,     &w.broadcast,      &w.all_gather,
          &w.reduce_scatter, &w.point_to_point, &w.control};
}

}  // namespace

std::vector<double> wire_values(const dtrain::WireStats& w) {
  dtrain::WireStats copy = w;
  std::vector<double> v{copy.counted ? 1.0 : 0.0};
  for (const dtrain::WireBytes* b : kinds(copy)) {
    v.push_back(static_cast<double>(b->intra_host));
    v.push_back(static_cast<double>(b->inter_host));
  }
  return v;
}

void add_wire_values(dtrain::WireStats& w, const double* values) {
  w.counted = w.counted || values[0] != 0;
  size_t i = 1;
  for (dtrain::WireBytes* b : kinds(w)) {
    b->intra_host += static_cast<uint64_t>(values[i++]);
    b->inter_host += static_cast<uint64_t>(values[i++]);
  }
}

double StepRecord::peak_rss_mib() const { return max_of(peak_rss_mib_per_rank); }
double StepRecord::model_state_mib() const { return max_of(model_state_mib_per_rank); }
double EpochRecord::peak_rss_mib() const { return max_of(peak_rss_mib_per_rank); }
double EpochRecord::model_state_mib() const { return max_of(model_state_mib_per_rank); }

std::optional<double> max_if_any(const std::vector<double>& values) {
  if (values.empty()) return std::nullopt;
  return max_of(values);
}
std::optional<double> StepRecord::cuda_peak_mib() const {
  return max_if_any(cuda_peak_mib_per_rank);
}
std::optional<double> EpochRecord::cuda_peak_mib() const {
  return max_if_any(cuda_peak_mib_per_rank);
}

void EpochTotals::add(const StepRecord& r) {
  loss_ += r.loss;
  grad_norm_ += r.grad_norm;
  step_time_ += r.step_time_s;
  comm_wait_ += r.comm_wait_s;
  tokens_ += r.tokens;
  ++steps_;
  last_ = r;
}

EpochRecord EpochTotals::record(int64_t epoch, int64_t epochs, double epoch_time_s) const {
  const double n = static_cast<double>(std::max<int64_t>(steps_, 1));
  EpochRecord e;
  e.epoch = epoch;
  e.epochs = epochs;
  e.loss = loss_ / n;
  e.grad_norm = grad_norm_ / n;
  e.step_time_s = step_time_ / n;
  e.comm_wait_s = comm_wait_ / n;
  e.epoch_time_s = epoch_time_s;
  e.tokens_per_s = static_cast<double>(tokens_) / std::max(epoch_time_s, 1e-9);
  e.peak_rss_mib_per_rank = last_.peak_rss_mib_per_rank;
  e.model_state_mib_per_rank = last_.model_state_mib_per_rank;
  e.cuda_peak_mib_per_rank = last_.cuda_peak_mib_per_rank;
  return e;
}

}  // namespace gpt2

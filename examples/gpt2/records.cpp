#include "records.h"

#include <algorithm>
#include <cmath>

namespace gpt2 {

double max_of(const std::vector<double>& values) {
  return values.empty() ? std::nan("") : *std::max_element(values.begin(), values.end());
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

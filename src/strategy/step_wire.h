// StepStats::wire: a strategy's bytes on the wire for one step, as the difference of two
// readings of wire_stats() summed over every communicator the strategy uses.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "dtrain/communicator.h"
#include "dtrain/wire_stats.h"

namespace dtrain {

class StepWire {
 public:
  StepWire() = default;
  // Null and repeated communicators are dropped: FSDP's shard group is often the world's.
  explicit StepWire(std::vector<CommunicatorPtr> comms) {
    for (auto& c : comms) {
      if (c && std::find(comms_.begin(), comms_.end(), c) == comms_.end()) {
        comms_.push_back(std::move(c));
      }
    }
  }

  // What every communicator has sent so far.
  WireStats read() const {
    WireStats sum;
    for (const auto& c : comms_) sum += wire_stats(*c);
    return sum;
  }
  // The step starts now.
  void start() {
    start_ = read();
    started_ = true;
  }
  bool started() const { return started_; }
  // Sent since start(); the next step must call start() again.
  WireStats finish() {
    started_ = false;
    return read().since(start_);
  }

 private:
  std::vector<CommunicatorPtr> comms_;
  WireStats start_;
  bool started_ = false;
};

}  // namespace dtrain

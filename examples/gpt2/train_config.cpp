#include "train_config.h"

#include <algorithm>
#include <cmath>

#include "dtrain/errors.h"

namespace gpt2 {

const char* to_string(StrategyKind v) {
  switch (v) {
    case StrategyKind::kSingle:
      return "single";
    case StrategyKind::kDdp:
      return "ddp";
    case StrategyKind::kFsdp:
      return "fsdp";
  }
  return "?";
}

const char* to_string(ModelKind v) { return v == ModelKind::kBert ? "bert" : "gpt2"; }

const char* to_string(DeviceKind v) { return v == DeviceKind::kCuda ? "cuda" : "cpu"; }

const char* to_string(Precision v) {
  switch (v) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "?";
}

const char* to_string(CommHookKind v) {
  switch (v) {
    case CommHookKind::kAllreduce:
      return "allreduce";
    case CommHookKind::kFp16:
      return "fp16";
    case CommHookKind::kBf16:
      return "bf16";
    case CommHookKind::kParameterServer:
      return "ps";
    case CommHookKind::kPowerSgd:
      return "powersgd";
  }
  return "?";
}

const char* to_string(TokenizerKind v) { return v == TokenizerKind::kByte ? "byte" : "gpt2"; }

const char* sharding_flag_name(dtrain::ShardingStrategy v) {
  switch (v) {
    case dtrain::ShardingStrategy::kFullShard:
      return "full";
    case dtrain::ShardingStrategy::kShardGradOp:
      return "grad_op";
    case dtrain::ShardingStrategy::kNoShard:
      return "no_shard";
    case dtrain::ShardingStrategy::kHybridShard:
      return "hybrid";
  }
  return "?";
}

const char* prefetch_flag_name(dtrain::BackwardPrefetch v) {
  switch (v) {
    case dtrain::BackwardPrefetch::kBackwardPre:
      return "pre";
    case dtrain::BackwardPrefetch::kBackwardPost:
      return "post";
    case dtrain::BackwardPrefetch::kNone:
      return "none";
  }
  return "?";
}

void check(bool ok, const std::string& message) {
  if (!ok) throw dtrain::InvalidArgument(message);
}

double learning_rate(const Config& c, int64_t step, int64_t total_steps) {
  if (step < c.warmup_steps) {
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - c.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) / span);
  return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
}

}  // namespace gpt2

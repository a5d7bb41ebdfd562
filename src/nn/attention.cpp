#include "dtrain/attention.h"

#include <c10/util/Optional.h>

#include "compat/attention.h"

namespace dtrain {
namespace {

// The compat kernels take the mask as an optional; an undefined tensor means none.
c10::optional<at::Tensor> mask_of(const AttentionOptions& options) {
  if (!options.attend.defined()) return c10::nullopt;
  return options.attend;
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options) {
  return compat::fused_attention(q, k, v, mask_of(options), options.causal, options.dropout_p);
}

at::Tensor explicit_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const AttentionOptions& options) {
  return compat::explicit_attention(q, k, v, mask_of(options), options.causal, options.dropout_p);
}

bool has_fused_attention() { return compat::kHasFusedAttention; }

}  // namespace dtrain

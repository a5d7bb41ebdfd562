#include "amp/bf16_check.h"

#include <c10/util/Exception.h>

namespace dtrain::amp {

bool warn_if_bf16_emulated(const Bf16CpuCheck& check, const std::string& who) {
  if (!check.warn) return false;
  const auto& injected = detail::Bf16CpuInjection::cpu(check);
  const std::string text = bf16_emulation_warning(injected ? *injected : CpuFeatures::detect());
  if (text.empty()) return false;
  // LibTorch's channel, not stderr: a program or test intercepts it with a c10 warning handler.
  TORCH_WARN("dtrain ", who, ": ", text);
  return true;
}

}  // namespace dtrain::amp

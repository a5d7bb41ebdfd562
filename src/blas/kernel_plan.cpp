// The choice of an OpenBLAS kernel family: pure functions of the BLAS, the CPU and the
// environment, so that every rule can be tested without the machine it is about.
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <string>

#include "dtrain/blas.h"

namespace dtrain {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// OpenBLAS's x86 kernel families (gotoblas_corename() and OPENBLAS_CORETYPE spell them this
// way, case aside) by the newest instructions their kernels use. "Unknown" is what OpenBLAS
// reports for a family it has no name for, not its fallback, so it is left out (never replaced).
const std::map<std::string, int>& kernel_levels() {
  static const std::map<std::string, int> levels = {
      {"katmai", 0},      {"coppermine", 0},    {"northwood", 0},  {"prescott", 0},
      {"banias", 0},      {"athlon", 0},        {"opteron", 0},    {"opteron_sse3", 0},
      {"core2", 1},       {"penryn", 1},        {"dunnington", 1}, {"atom", 1},
      {"nano", 1},        {"bobcat", 1},        {"barcelona", 1},  {"nehalem", 2},
      {"sandybridge", 3}, {"bulldozer", 3},     {"piledriver", 3}, {"steamroller", 3},
      {"excavator", 3},   {"haswell", 4},       {"zen", 4},        {"skylakex", 5},
      {"cooperlake", 5},  {"sapphirerapids", 5}};
  return levels;
}

bool is_x86_64(const CpuFeatures& cpu) { return cpu.arch == "x86_64" || cpu.arch == "amd64"; }

std::string lookup(const std::map<std::string, std::string>& env, const char* name) {
  const auto it = env.find(name);
  return it == env.end() ? std::string() : it->second;
}

}  // namespace

bool is_generic_openblas_kernel(const std::string& kernel) {
  const std::string k = lower(kernel);
  // armv8: what a 64-bit ARM DYNAMIC_ARCH build runs on a core it does not know.
  return openblas_kernel_level(k) == 0 || k == "armv8";
}

int openblas_kernel_level(const std::string& kernel) {
  const auto it = kernel_levels().find(lower(kernel));
  return it == kernel_levels().end() ? -1 : it->second;
}

std::string best_openblas_kernel(const CpuFeatures& cpu) {
  if (!is_x86_64(cpu)) return "";
  // The SkylakeX kernels use AVX-512 F, CD, BW, DQ and VL (Knights Landing, with F and CD
  // only, runs Haswell's).
  if (cpu.avx512f && cpu.avx512cd && cpu.avx512bw && cpu.avx512dq && cpu.avx512vl) {
    return "SkylakeX";
  }
  if (cpu.avx2 && cpu.fma) return "Haswell";
  if (cpu.avx) return "Sandybridge";
  if (cpu.sse4_2) return "Nehalem";
  if (cpu.ssse3) return "Core2";
  return "";
}

BlasKernelPlan plan_blas_kernel(const BlasInfo& blas, const CpuFeatures& cpu,
                                const std::map<std::string, std::string>& env,
                                BlasKernelPolicy policy) {
  BlasKernelPlan plan;
  plan.kernel = blas.kernel;
  const std::string described = blas.to_string();
  const std::string best = best_openblas_kernel(cpu);
  const int level = openblas_kernel_level(blas.kernel);
  // A better family exists when ours is generic or ranks below the CPU's best; an unknown name
  // (level -1) is assumed to be good.
  const bool better = blas.is_openblas() && blas.dynamic_arch && !best.empty() && level >= 0 &&
                      level < openblas_kernel_level(best);
  const std::string cpu_note = "this CPU's " + cpu.summary();

  const auto coretype = env.find(kOpenBlasCoretypeEnv);
  const std::string choice = lookup(env, kBlasChoiceEnv);
  if (coretype != env.end()) {
    const std::string set = std::string(kOpenBlasCoretypeEnv) + "=" + coretype->second;
    if (choice.rfind("replaced:", 0) == 0) {
      plan.action = BlasKernelPlan::Action::kSelected;
      plan.note = described + " (" + set + " chosen by dtrain for " + cpu_note +
                  "; OpenBLAS's own choice: " + choice.substr(9) + ")";
    } else {
      plan.action = BlasKernelPlan::Action::kUserSet;
      plan.note = described + " (" + set + " set in the environment, kept";
      if (better) {
        plan.missed_kernel = best;
        plan.note += "; " + cpu_note + " could run " + best;
      }
      plan.note += ")";
    }
    return plan;
  }
  if (policy == BlasKernelPolicy::kKeep || !choice.empty()) {
    plan.action = BlasKernelPlan::Action::kKept;
    if (choice.empty()) plan.environment[kBlasChoiceEnv] = "keep";
    plan.note = described + " (left as loaded";
    if (better) {
      plan.missed_kernel = best;
      plan.note += "; " + cpu_note + " could run " + best;
    }
    plan.note += ")";
    return plan;
  }
  if (!better) {
    plan.note = described;
    if (blas.is_openblas() && !blas.dynamic_arch) {
      plan.note += " (built for one CPU family: OPENBLAS_CORETYPE would have no effect)";
    } else if (blas.is_openblas() && is_generic_openblas_kernel(blas.kernel)) {
      plan.note += " (generic kernels; nothing better known for " + cpu_note + ")";
    }
    return plan;
  }
  plan.action = BlasKernelPlan::Action::kSelect;
  plan.kernel = best;
  plan.environment[kOpenBlasCoretypeEnv] = best;
  plan.environment[kBlasChoiceEnv] = "replaced:" + blas.kernel;
  plan.note = described + (is_generic_openblas_kernel(blas.kernel) ? ", generic" : ", below") +
              " for " + cpu_note + ": selecting " + kOpenBlasCoretypeEnv + "=" + best;
  return plan;
}

std::map<std::string, std::string> blas_environment_from_env() {
  std::map<std::string, std::string> env;
  for (const char* name : {kOpenBlasCoretypeEnv, kBlasChoiceEnv}) {
    if (const char* value = std::getenv(name)) env[name] = value;
  }
  return env;
}

}  // namespace dtrain

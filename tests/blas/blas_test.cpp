// BLAS kernel selection (include/dtrain/blas.h): the feature-to-kernel mapping, what counts as
// generic, and the rule that a variable already in the environment is never replaced. The
// plan is a pure function, so every case runs on any machine.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/blas.h"
#include "support/scoped_env.h"

namespace dtrain {
namespace {

using Action = BlasKernelPlan::Action;
using Env = std::map<std::string, std::string>;

CpuFeatures x86(int level) {
  CpuFeatures c;
  c.arch = "x86_64";
  c.vendor = "GenuineIntel";
  c.sse3 = level >= 0;
  c.ssse3 = level >= 1;
  c.sse4_2 = level >= 2;
  c.avx = level >= 3;
  c.avx2 = c.fma = level >= 4;
  c.avx512f = c.avx512cd = c.avx512bw = c.avx512dq = c.avx512vl = level >= 5;
  return c;
}

CpuFeatures avx512() { return x86(5); }

BlasInfo openblas(const std::string& kernel, bool dynamic_arch = true) {
  BlasInfo b;
  b.library = "OpenBLAS";
  b.version = "0.3.21";
  b.threading = "OpenMP";
  b.kernel = kernel;
  b.dynamic_arch = dynamic_arch;
  return b;
}

TEST(BlasKernels, GenericKernelsAreOpenBlasFallbacks) {
  for (const char* k : {"Prescott", "prescott", "PRESCOTT", "Katmai", "Northwood", "Banias",
                        "Athlon", "Opteron_SSE3", "armv8"}) {
    EXPECT_TRUE(is_generic_openblas_kernel(k)) << k;
  }
  // "Unknown" is OpenBLAS's name for a family it cannot name, not its fallback.
  for (const char* k : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "Nehalem", "Core2",
                        "Sandybridge", "Unknown", "", "neoversen1"}) {
    EXPECT_FALSE(is_generic_openblas_kernel(k)) << k;
  }
}

TEST(BlasKernels, LevelsOrderFamiliesByInstructionSet) {
  EXPECT_EQ(openblas_kernel_level("Prescott"), 0);
  EXPECT_EQ(openblas_kernel_level("Core2"), 1);
  EXPECT_EQ(openblas_kernel_level("Nehalem"), 2);
  EXPECT_EQ(openblas_kernel_level("Sandybridge"), 3);
  EXPECT_EQ(openblas_kernel_level("Haswell"), 4);
  EXPECT_EQ(openblas_kernel_level("zen"), 4);
  EXPECT_EQ(openblas_kernel_level("SkylakeX"), 5);
  EXPECT_EQ(openblas_kernel_level("Cooperlake"), 5);
  EXPECT_EQ(openblas_kernel_level("Zen5"), -1);
  EXPECT_EQ(openblas_kernel_level("Unknown"), -1);
}

TEST(BlasKernels, BestKernelFollowsCpuFeatures) {
  EXPECT_EQ(best_openblas_kernel(x86(5)), "SkylakeX");
  EXPECT_EQ(best_openblas_kernel(x86(4)), "Haswell");
  EXPECT_EQ(best_openblas_kernel(x86(3)), "Sandybridge");
  EXPECT_EQ(best_openblas_kernel(x86(2)), "Nehalem");
  EXPECT_EQ(best_openblas_kernel(x86(1)), "Core2");
  EXPECT_EQ(best_openblas_kernel(x86(0)), "");

  // Knights Landing: AVX-512 F and CD but not BW/DQ/VL, which the SkylakeX kernels use.
  CpuFeatures knl = x86(4);
  knl.avx512f = knl.avx512cd = true;
  EXPECT_EQ(best_openblas_kernel(knl), "Haswell");
  // AVX2 without FMA (the OS may hide nothing, but a hypervisor can): no Haswell kernels.
  CpuFeatures no_fma = x86(4);
  no_fma.fma = false;
  EXPECT_EQ(best_openblas_kernel(no_fma), "Sandybridge");
  // Other architectures are never given an x86 family.
  CpuFeatures arm;
  arm.arch = "aarch64";
  EXPECT_EQ(best_openblas_kernel(arm), "");
}

TEST(BlasKernelPlan, GenericFallbackSelectsTheCpusBestFamily) {
  const BlasKernelPlan p = plan_blas_kernel(openblas("Prescott"), avx512(), {});
  EXPECT_EQ(p.action, Action::kSelect);
  EXPECT_EQ(p.kernel, "SkylakeX");
  EXPECT_EQ(p.environment,
            (Env{{"OPENBLAS_CORETYPE", "SkylakeX"}, {"DTRAIN_BLAS_CHOICE", "replaced:Prescott"}}));
  EXPECT_NE(p.note.find("Prescott, generic"), std::string::npos) << p.note;

  EXPECT_EQ(plan_blas_kernel(openblas("Prescott"), x86(4), {}).kernel, "Haswell");
  EXPECT_EQ(plan_blas_kernel(openblas("Katmai"), x86(2), {}).kernel, "Nehalem");
}

TEST(BlasKernelPlan, OlderFamilyThanTheCpuSupportsIsReplaced) {
  const BlasKernelPlan p = plan_blas_kernel(openblas("Haswell"), avx512(), {});
  EXPECT_EQ(p.action, Action::kSelect);
  EXPECT_EQ(p.environment.at("OPENBLAS_CORETYPE"), "SkylakeX");
  EXPECT_NE(p.note.find("below"), std::string::npos) << p.note;
}

TEST(BlasKernelPlan, FittingOrUnknownKernelsAreLeftAlone) {
  struct Case {
    BlasInfo blas;
    CpuFeatures cpu;
  };
  BlasInfo blis;
  blis.library = "BLIS";
  const std::vector<Case> cases = {
      {openblas("SkylakeX"), avx512()},
      {openblas("Cooperlake"), avx512()},       // same level as SkylakeX
      {openblas("Zen"), x86(4)},                // same level as Haswell
      {openblas("Haswell"), x86(3)},            // never downgraded
      {openblas("Zen5"), avx512()},             // a name this table does not know
      {openblas("Unknown"), avx512()},          // OpenBLAS could not name it
      {openblas("Prescott"), x86(0)},           // nothing better to offer
      {openblas("Prescott", false), avx512()},  // one-target build: the variable is ignored
      {BlasInfo{}, avx512()},                   // reference BLAS
      {blis, avx512()},
  };
  for (const auto& c : cases) {
    const BlasKernelPlan p = plan_blas_kernel(c.blas, c.cpu, {});
    EXPECT_EQ(p.action, Action::kNone) << c.blas.to_string() << ": " << p.note;
    EXPECT_TRUE(p.environment.empty()) << c.blas.to_string();
    EXPECT_EQ(p.kernel, c.blas.kernel);
  }
  CpuFeatures arm;
  arm.arch = "aarch64";
  EXPECT_EQ(plan_blas_kernel(openblas("armv8"), arm, {}).action, Action::kNone);
  EXPECT_NE(plan_blas_kernel(openblas("Prescott", false), avx512(), {}).note.find("no effect"),
            std::string::npos);
}

TEST(BlasKernelPlan, NeverOverridesOpenBlasCoretypeSetByTheUser) {
  // Even a bad value is kept, and reported with what the CPU could run.
  for (const std::string value : {"Prescott", "", "NoSuchCore", "Haswell"}) {
    const BlasInfo loaded = openblas(value == "Haswell" ? "Haswell" : "Prescott");
    const BlasKernelPlan p = plan_blas_kernel(loaded, avx512(), {{"OPENBLAS_CORETYPE", value}});
    EXPECT_EQ(p.action, Action::kUserSet) << value;
    EXPECT_TRUE(p.environment.empty()) << value;
    EXPECT_EQ(p.kernel, loaded.kernel);
    EXPECT_EQ(p.missed_kernel, "SkylakeX") << value;
    EXPECT_NE(p.note.find("OPENBLAS_CORETYPE=" + value + " set in the environment, kept"),
              std::string::npos)
        << p.note;
  }
  const BlasKernelPlan good =
      plan_blas_kernel(openblas("SkylakeX"), avx512(), {{"OPENBLAS_CORETYPE", "SkylakeX"}});
  EXPECT_EQ(good.action, Action::kUserSet);
  EXPECT_EQ(good.missed_kernel, "");
  // Whatever the BLAS: the variable is the user's.
  EXPECT_TRUE(plan_blas_kernel(BlasInfo{}, avx512(), {{"OPENBLAS_CORETYPE", "Haswell"}})
                  .environment.empty());
}

TEST(BlasKernelPlan, ProcessesStartedWithAChoiceDoNotChooseAgain) {
  // What a rank (or gpt2_train after restarting) sees after a launcher selected SkylakeX.
  const BlasKernelPlan p = plan_blas_kernel(
      openblas("SkylakeX"), avx512(),
      {{"OPENBLAS_CORETYPE", "SkylakeX"}, {"DTRAIN_BLAS_CHOICE", "replaced:Prescott"}});
  EXPECT_EQ(p.action, Action::kSelected);
  EXPECT_TRUE(p.environment.empty());
  EXPECT_NE(p.note.find("OpenBLAS's own choice: Prescott"), std::string::npos) << p.note;

  // A launcher under "keep": the ranks keep the generic kernel too.
  const BlasKernelPlan kept =
      plan_blas_kernel(openblas("Prescott"), avx512(), {{"DTRAIN_BLAS_CHOICE", "keep"}});
  EXPECT_EQ(kept.action, Action::kKept);
  EXPECT_TRUE(kept.environment.empty());
  EXPECT_EQ(kept.missed_kernel, "SkylakeX");
}

TEST(BlasKernelPlan, KeepPolicyLeavesTheKernelAndTellsTheRanks) {
  const BlasKernelPlan p =
      plan_blas_kernel(openblas("Prescott"), avx512(), {}, BlasKernelPolicy::kKeep);
  EXPECT_EQ(p.action, Action::kKept);
  EXPECT_EQ(p.kernel, "Prescott");
  EXPECT_EQ(p.environment, (Env{{"DTRAIN_BLAS_CHOICE", "keep"}}));
  EXPECT_NE(p.note.find("could run SkylakeX"), std::string::npos) << p.note;
}

TEST(BlasKernelPlan, NeverAddsAVariableThatIsAlreadySet) {
  const std::vector<Env> envs = {{},
                                 {{"OPENBLAS_CORETYPE", "Prescott"}},
                                 {{"OPENBLAS_CORETYPE", ""}},
                                 {{"DTRAIN_BLAS_CHOICE", "keep"}},
                                 {{"DTRAIN_BLAS_CHOICE", "replaced:Haswell"}},
                                 {{"OPENBLAS_CORETYPE", "Zen"}, {"DTRAIN_BLAS_CHOICE", "x"}}};
  for (const char* kernel : {"Prescott", "Katmai", "Core2", "Haswell", "SkylakeX", "Zen5", ""}) {
    for (int level = 0; level <= 5; ++level) {
      for (const auto& env : envs) {
        for (auto policy : {BlasKernelPolicy::kAuto, BlasKernelPolicy::kKeep}) {
          const BlasKernelPlan p = plan_blas_kernel(openblas(kernel), x86(level), env, policy);
          for (const auto& [name, value] : p.environment) {
            EXPECT_EQ(env.count(name), 0u) << kernel << " level " << level << ": " << name;
          }
          if (p.action != Action::kSelect) {
            EXPECT_EQ(p.environment.count("OPENBLAS_CORETYPE"), 0u);
          }
        }
      }
    }
  }
}

using dtrain::testing::ScopedEnv;

TEST(BlasEnvironment, FromEnvReadsOnlyTheBlasVariables) {
  ScopedEnv coretype("OPENBLAS_CORETYPE", "Zen");
  ScopedEnv choice("DTRAIN_BLAS_CHOICE", std::nullopt);
  EXPECT_EQ(blas_environment_from_env(), (Env{{"OPENBLAS_CORETYPE", "Zen"}}));
  ScopedEnv empty("OPENBLAS_CORETYPE", "");
  EXPECT_EQ(blas_environment_from_env(), (Env{{"OPENBLAS_CORETYPE", ""}}));  // set, though empty
}

TEST(BlasInfo, ProbeReadsOpenBlasQueryFunctions) {
  ScopedEnv coretype("OPENBLAS_CORETYPE", std::nullopt);
  ScopedEnv fake("FAKE_OPENBLAS_KERNEL", "Prescott");
  const BlasInfo b = BlasInfo::probe(DTRAIN_FAKE_OPENBLAS);
  EXPECT_EQ(b.library, "OpenBLAS");
  EXPECT_EQ(b.version, "0.3.21");
  EXPECT_EQ(b.kernel, "Prescott");
  EXPECT_EQ(b.threading, "pthreads");
  EXPECT_TRUE(b.dynamic_arch);
  EXPECT_EQ(b.to_string(), "OpenBLAS 0.3.21 (pthreads), kernel Prescott");

  const BlasInfo missing = BlasInfo::probe("libdtrain-no-such-blas.so.3");
  EXPECT_EQ(missing.library, "unknown");
  EXPECT_EQ(missing.to_string(), "unknown BLAS");
}

TEST(BlasInfo, ActiveBlasIsIdentifiedOrUnknown) {
  // LibTorch's BLAS is whatever libblas.so.3 points to here; only consistency is checked.
  const BlasInfo b = BlasInfo::active();
  EXPECT_FALSE(b.to_string().empty());
  if (b.is_openblas()) {
    EXPECT_FALSE(b.kernel.empty()) << b.config;
    EXPECT_FALSE(b.version.empty()) << b.config;
  } else {
    EXPECT_TRUE(b.kernel.empty());
  }
}

TEST(CpuFeatures, DetectIsConsistent) {
  const CpuFeatures c = CpuFeatures::detect();
  EXPECT_FALSE(c.arch.empty());
  EXPECT_FALSE(c.summary().empty());
  if (c.arch == "x86_64") {
    EXPECT_FALSE(c.vendor.empty());
    EXPECT_TRUE(c.sse3);  // every x86-64 CPU of the last 15 years
    EXPECT_TRUE(!c.avx2 || c.avx);
    EXPECT_TRUE(!c.avx512bw || c.avx512f);
    EXPECT_NE(best_openblas_kernel(c), "");
  } else {
    EXPECT_FALSE(c.avx);
  }
}

TEST(CpuFeatures, SummaryNamesTheWidestLevel) {
  EXPECT_EQ(x86(5).summary(), "avx512 (f cd bw dq vl)");
  CpuFeatures bf16 = x86(5);
  bf16.avx512_bf16 = bf16.amx_bf16 = true;
  EXPECT_EQ(bf16.summary(), "avx512 (f cd bw dq vl bf16 amx-bf16)");
  EXPECT_EQ(x86(4).summary(), "avx2+fma");
  EXPECT_EQ(x86(2).summary(), "sse4.2");
  EXPECT_EQ(CpuFeatures{}.summary(), "none");
}

// ---- bf16: native or emulated ----

TEST(CpuBf16, NativeMeansAvx512Bf16OrAmxBf16) {
  EXPECT_FALSE(x86(4).native_bf16());
  EXPECT_FALSE(avx512().native_bf16());  // AVX-512 alone: emulated
  EXPECT_EQ(avx512().bf16_features(), "");
  CpuFeatures c = avx512();
  c.avx512_bf16 = true;
  EXPECT_TRUE(c.native_bf16());
  EXPECT_EQ(c.bf16_features(), "avx512_bf16");
  c.amx_bf16 = true;
  EXPECT_EQ(c.bf16_features(), "avx512_bf16 amx_bf16");
  c.avx512_bf16 = false;
  EXPECT_TRUE(c.native_bf16());
  EXPECT_EQ(c.bf16_features(), "amx_bf16");
}

TEST(CpuBf16, DetectAgreesWithTheKernelsCpuFlags) {
  const CpuFeatures c = CpuFeatures::detect();
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line) && line.rfind("flags", 0) != 0) {
  }
  if (line.empty() || c.arch != "x86_64") GTEST_SKIP() << "no x86 flags line in /proc/cpuinfo";
  const auto has = [&](const std::string& flag) {
    return (line + " ").find(" " + flag + " ") != std::string::npos;
  };
  EXPECT_EQ(c.avx512_bf16, has("avx512_bf16")) << line;
  EXPECT_EQ(c.amx_bf16, has("amx_bf16")) << line;
}

TEST(CpuBf16, WarningNamesTheCpuTheMeasuredSlowdownAndFp32) {
  CpuFeatures native = avx512();
  native.avx512_bf16 = true;
  EXPECT_EQ(bf16_emulation_warning(native), "");

  CpuFeatures avx2 = x86(4);
  avx2.model = "AMD EPYC";
  const std::string w = bf16_emulation_warning(avx2);
  EXPECT_NE(w.find("bf16 is emulated on this CPU (AMD EPYC, x86_64 avx2+fma; no avx512_bf16 "
                   "or amx_bf16)"),
            std::string::npos)
      << w;
  EXPECT_NE(w.find("18.9 s/step against 0.8-1.0 s/step"), std::string::npos) << w;
  EXPECT_NE(w.find("fp32 is faster on this CPU"), std::string::npos) << w;
  EXPECT_NE(w.find("still runs"), std::string::npos) << w;

  // AVX-512 without bf16: the slowdown there was never measured, and the text says so.
  const std::string w512 = bf16_emulation_warning(avx512());
  EXPECT_NE(w512.find("has not been measured"), std::string::npos) << w512;
  EXPECT_NE(w512.find("18.9 s/step"), std::string::npos) << w512;

  CpuFeatures arm;
  arm.arch = "aarch64";
  EXPECT_NE(bf16_emulation_warning(arm).find("cannot tell"), std::string::npos);
}

TEST(CpuBf16, HideHookClearsOnlyTheBf16Features) {
  CpuFeatures c = avx512();
  c.avx512_bf16 = c.amx_bf16 = true;
  const CpuFeatures hidden = apply_cpu_feature_hooks(c, {{kHideNativeBf16Env, "1"}});
  EXPECT_FALSE(hidden.native_bf16());
  EXPECT_TRUE(hidden.avx512f && hidden.avx512bw);  // the BLAS kernel choice is unchanged
  EXPECT_EQ(best_openblas_kernel(hidden), best_openblas_kernel(c));
  EXPECT_TRUE(apply_cpu_feature_hooks(c, {{kHideNativeBf16Env, "0"}}).native_bf16());
  EXPECT_TRUE(apply_cpu_feature_hooks(c, {{kHideNativeBf16Env, ""}}).native_bf16());
  EXPECT_TRUE(apply_cpu_feature_hooks(c, {}).native_bf16());
  try {
    apply_cpu_feature_hooks(c, {{kHideNativeBf16Env, "yes"}});
    FAIL() << "a value other than 0 or 1 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_HIDE_NATIVE_BF16 must be 0 or 1, got 'yes'"),
              std::string::npos)
        << e.what();
  }
  ScopedEnv hide(kHideNativeBf16Env, "1");
  EXPECT_FALSE(cpu_features_from_env().native_bf16());
}

}  // namespace
}  // namespace dtrain

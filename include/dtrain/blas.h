// BLAS kernels: which BLAS a process runs, which OpenBLAS kernel family it picked, and which
// family the CPU could run instead.
//
// OpenBLAS (a DYNAMIC_ARCH build, as Debian's) chooses its kernels once, when it loads, from
// the CPU model. On a CPU it does not know it falls back to a generic family ("Prescott",
// SSE3) or to an older one than the CPU supports, and matrix products run several times
// slower than they could (4.5x for Prescott vs SkylakeX on an AVX-512 Xeon). It honours the
// OPENBLAS_CORETYPE environment variable, but only at load time, so a process can only be
// *started* with a better choice: plan_blas_kernel() decides it, and dtrain-run and gpt2_train
// add the result to the environment of the processes they start. A value the user set in
// OPENBLAS_CORETYPE is never replaced. See docs/blas.md.
//
// No OpenBLAS header is needed: its query functions are looked up at run time, so dtrain runs
// the same on reference BLAS, BLIS or MKL (which are reported, and left alone).
//
// The same probe says whether the CPU computes bf16 natively (CpuFeatures::native_bf16()):
// without avx512_bf16 or AMX-BF16, bf16 mixed precision converts every value in software and
// runs many times slower than fp32 (docs/benchmarks-history.md, "bf16 vs fp32 by CPU class").
#pragma once

#include <map>
#include <optional>
#include <string>

namespace dtrain {

namespace detail {
struct Bf16CpuInjection;
}

// The CPU features that decide which kernels can run. A vector extension counts only when the
// operating system also saves its registers (AVX, AVX-512), as the compiler's
// __builtin_cpu_supports checks.
struct CpuFeatures {
  std::string arch;    // "x86_64", "aarch64", ...
  std::string vendor;  // cpuid vendor: "GenuineIntel", "AuthenticAMD", ...; "" off x86
  std::string model;   // brand string, e.g. "AMD EPYC"; "" when unknown
  bool sse3 = false, ssse3 = false, sse4_2 = false, avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512cd = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512_bf16 = false;
  // AMX with bf16 tiles (Sapphire Rapids and later), counted when the OS saves tile state.
  bool amx_bf16 = false;

  // This machine's CPU (cpuid; every flag false on other architectures).
  static CpuFeatures detect();
  // The widest vector level, e.g. "avx512 (f cd bw dq vl bf16)", "avx2+fma", "sse4.2", "none";
  // " amx-bf16" is added inside the parentheses when present.
  std::string summary() const;

  // True when the CPU computes bf16 in hardware: avx512_bf16 or amx_bf16. Only x86-64 is
  // probed: false on other architectures (dtrain cannot tell there).
  bool native_bf16() const { return avx512_bf16 || amx_bf16; }
  // The native bf16 features present ("avx512_bf16", "amx_bf16", "avx512_bf16 amx_bf16");
  // "" when none.
  std::string bf16_features() const;
};

// The warning for bf16 compute (autocast, FSDP's bf16 param_dtype, gpt2_train --precision
// bf16) on `cpu`: that bf16 is emulated there, the slowdown measured on such a CPU (or that
// it was not measured for the CPU's class), and that fp32 is faster. "" when
// cpu.native_bf16(). The one text every place that warns uses. Pure.
std::string bf16_emulation_warning(const CpuFeatures& cpu);

// What CPU bf16 mixed precision (dtrain::Autocast, FsdpOptions::mixed_precision) does about
// a CPU without native bf16: it runs (bf16's numerics may be what the user wants) and warns
// once through LibTorch's warning channel (TORCH_WARN; a c10 warning handler intercepts it).
// The CPU judged is CpuFeatures::detect().
struct Bf16CpuCheck {
  // false: no warning (for a program that says it itself, as gpt2_train does once per job).
  bool warn = true;

 private:
  // Tests judge an injected CPU instead (src/amp/bf16_check.h); unset: detect().
  friend struct detail::Bf16CpuInjection;
  std::optional<CpuFeatures> cpu_;
};

// Test hook: DTRAIN_HIDE_NATIVE_BF16=1 makes dtrain's programs (gpt2_train, dtrain-run and
// through it scripts/run-comparison.sh) treat this CPU as one without native bf16, so the
// warning and the comparison's skipped bf16 variant can be tested on any CPU. It changes only
// what dtrain reports and decides, not how LibTorch computes.
inline constexpr const char* kHideNativeBf16Env = "DTRAIN_HIDE_NATIVE_BF16";

// `cpu` with avx512_bf16 and amx_bf16 cleared when env holds DTRAIN_HIDE_NATIVE_BF16=1;
// unchanged when it is absent, "" or "0". Throws std::invalid_argument naming the variable
// for any other value. Pure.
CpuFeatures apply_cpu_feature_hooks(CpuFeatures cpu, const std::map<std::string, std::string>& env);

// CpuFeatures::detect() with this process's DTRAIN_HIDE_NATIVE_BF16 applied: what gpt2_train
// and dtrain-run report and decide with. The only place dtrain reads that variable; the
// library's own check (Bf16CpuCheck) ignores it.
CpuFeatures cpu_features_from_env();

// The BLAS a process uses, as far as it can be identified.
struct BlasInfo {
  std::string library = "unknown";  // "OpenBLAS", "BLIS", "MKL", or "unknown" (e.g. reference)
  std::string version;              // e.g. "0.3.21"; "" when unknown
  std::string kernel;         // OpenBLAS's kernel family ("Prescott", "Haswell", ...); "" otherwise
  std::string threading;      // OpenBLAS: "sequential", "pthreads" or "OpenMP"; "" otherwise
  std::string config;         // openblas_get_config(), verbatim
  bool dynamic_arch = false;  // OpenBLAS chose `kernel` at load time (OPENBLAS_CORETYPE works)

  bool is_openblas() const { return library == "OpenBLAS"; }
  // "OpenBLAS 0.3.21 (OpenMP), kernel SkylakeX"; "unknown BLAS".
  std::string to_string() const;

  // The BLAS this process has loaded (LibTorch's), found by looking up OpenBLAS's, BLIS's and
  // MKL's own query functions among the loaded libraries.
  static BlasInfo active();
  // Loads `library` (a name or path as dlopen takes it, e.g. "libblas.so.3") and reports it,
  // with the kernel it chose under this process's environment: for a launcher that does not
  // link a BLAS itself. The library stays loaded. "unknown" when it cannot be loaded.
  static BlasInfo probe(const std::string& library);
};

// True for the kernel families OpenBLAS falls back to on a CPU it does not recognise or on a
// 32-bit x86 ("Prescott", "Katmai", "Unknown" and the other SSE2/SSE3-era families; "armv8"
// on 64-bit ARM). Case-insensitive, as OPENBLAS_CORETYPE is.
bool is_generic_openblas_kernel(const std::string& kernel);

// Where an x86-64 OpenBLAS kernel family stands by the instructions it uses: 0 generic
// (SSE2/SSE3), 1 SSSE3, 2 SSE4.2, 3 AVX, 4 AVX2+FMA, 5 AVX-512. -1 for a name this table does
// not know, which is never replaced.
int openblas_kernel_level(const std::string& kernel);

// The best OpenBLAS kernel family `cpu` can run: "SkylakeX" (AVX-512 F/CD/BW/DQ/VL),
// "Haswell" (AVX2 and FMA), "Sandybridge" (AVX), "Nehalem" (SSE4.2), "Core2" (SSSE3). ""
// when nothing beats the generic kernels, or the CPU is not x86-64 (no choice is made there).
std::string best_openblas_kernel(const CpuFeatures& cpu);

// The variable OpenBLAS reads at load time to force a kernel family.
inline constexpr const char* kOpenBlasCoretypeEnv = "OPENBLAS_CORETYPE";
// Set by a dtrain launcher for the processes it starts: "replaced:<kernel OpenBLAS picked>"
// next to the OPENBLAS_CORETYPE it chose, or "keep" under BlasKernelPolicy::kKeep. A process
// that sees it never chooses again (it is also gpt2_train's guard against re-executing twice).
inline constexpr const char* kBlasChoiceEnv = "DTRAIN_BLAS_CHOICE";

enum class BlasKernelPolicy {
  kAuto,  // select a better family when OpenBLAS runs a generic or older one than the CPU can
  kKeep,  // leave the BLAS as it loads
};

// What to do about the BLAS kernel of processes started from here, and what runs now.
struct BlasKernelPlan {
  enum class Action {
    kNone,      // not OpenBLAS, a build for one target, or the kernel already fits the CPU
    kSelect,    // start processes with `environment` added
    kUserSet,   // OPENBLAS_CORETYPE was set by the user: kept, even when worse than the CPU allows
    kSelected,  // OPENBLAS_CORETYPE was chosen by a dtrain launcher (DTRAIN_BLAS_CHOICE)
    kKept,      // BlasKernelPolicy::kKeep here or in the launcher
  };
  Action action = Action::kNone;
  // The kernel family processes started with `environment` run ("" when not OpenBLAS).
  std::string kernel;
  // kUserSet, kKept: the better family this CPU supports that they will not run ("" when none).
  std::string missed_kernel;
  // Variables to add to the environment of processes started from here. Never holds a
  // variable that is already set.
  std::map<std::string, std::string> environment;
  // One line for a log: what runs and why, e.g. "OpenBLAS 0.3.21 (OpenMP), kernel Haswell,
  // below this CPU's avx512: selecting OPENBLAS_CORETYPE=SkylakeX".
  std::string note;
};

// Decides the BLAS kernel of processes started from here, given the BLAS loaded here (or
// probed), the CPU, and the environment (at least OPENBLAS_CORETYPE and DTRAIN_BLAS_CHOICE when
// set). Selects only for a DYNAMIC_ARCH OpenBLAS whose kernel is generic or a lower level than
// best_openblas_kernel(cpu), and never when OPENBLAS_CORETYPE or DTRAIN_BLAS_CHOICE is set.
// Pure: reads neither the process environment nor the CPU.
BlasKernelPlan plan_blas_kernel(const BlasInfo& blas, const CpuFeatures& cpu,
                                const std::map<std::string, std::string>& env,
                                BlasKernelPolicy policy = BlasKernelPolicy::kAuto);

// The variables plan_blas_kernel() looks at (OPENBLAS_CORETYPE, DTRAIN_BLAS_CHOICE), as this
// process's environment has them (unset ones are absent). The only place dtrain reads them.
std::map<std::string, std::string> blas_environment_from_env();

}  // namespace dtrain

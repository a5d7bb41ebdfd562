#include <sys/utsname.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/blas.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace dtrain {
namespace {

#if defined(__x86_64__) || defined(__i386__)
std::string cpuid_vendor() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return "";
  char v[13];
  std::memcpy(v, &b, 4);
  std::memcpy(v + 4, &d, 4);
  std::memcpy(v + 8, &c, 4);
  v[12] = '\0';
  return v;
}

std::string cpuid_brand() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0x80000000u, &a, &b, &c, &d) == 0 || a < 0x80000004u) return "";
  char brand[49] = {};
  for (unsigned leaf = 0; leaf < 3; ++leaf) {
    __get_cpuid(0x80000002u + leaf, &a, &b, &c, &d);
    const unsigned regs[4] = {a, b, c, d};
    std::memcpy(brand + leaf * 16, regs, 16);
  }
  std::string s = brand;
  const auto first = s.find_first_not_of(' ');
  const auto last = s.find_last_not_of(' ');
  return first == std::string::npos ? "" : s.substr(first, last - first + 1);
}

// AMX-BF16 (cpuid 7.0:EDX bit 22) with the tile state enabled by the OS (XCR0 bits 17 and 18,
// readable only when OSXSAVE is set).
bool amx_bf16_usable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c & (1u << 27)) == 0) return false;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || (d & (1u << 22)) == 0) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const unsigned tiles = (1u << 17) | (1u << 18);
  return (lo & tiles) == tiles;
}
#endif

}  // namespace

CpuFeatures CpuFeatures::detect() {
  CpuFeatures f;
  utsname u{};
  if (uname(&u) == 0) f.arch = u.machine;
#if defined(__x86_64__) || defined(__i386__)
  // __builtin_cpu_supports reports AVX and AVX-512 only when the OS saves their registers
  // (XGETBV), which is what matters for running OpenBLAS's kernels.
  __builtin_cpu_init();
  f.vendor = cpuid_vendor();
  f.model = cpuid_brand();
  f.sse3 = __builtin_cpu_supports("sse3");
  f.ssse3 = __builtin_cpu_supports("ssse3");
  f.sse4_2 = __builtin_cpu_supports("sse4.2");
  f.avx = __builtin_cpu_supports("avx");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512cd = __builtin_cpu_supports("avx512cd");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  f.amx_bf16 = amx_bf16_usable();
#endif
  return f;
}

std::string CpuFeatures::summary() const {
  if (avx512f) {
    std::string s = "avx512 (f";
    for (const auto& [has, name] :
         std::vector<std::pair<bool, const char*>>{{avx512cd, "cd"},
                                                   {avx512bw, "bw"},
                                                   {avx512dq, "dq"},
                                                   {avx512vl, "vl"},
                                                   {avx512_bf16, "bf16"},
                                                   {amx_bf16, "amx-bf16"}}) {
      if (has) s += std::string(" ") + name;
    }
    return s + ")";
  }
  if (avx2) return fma ? "avx2+fma" : "avx2";
  if (avx) return "avx";
  if (sse4_2) return "sse4.2";
  if (ssse3) return "ssse3";
  if (sse3) return "sse3";
  return "none";
}

std::string CpuFeatures::bf16_features() const {
  if (avx512_bf16 && amx_bf16) return "avx512_bf16 amx_bf16";
  if (avx512_bf16) return "avx512_bf16";
  return amx_bf16 ? "amx_bf16" : "";
}

std::string bf16_emulation_warning(const CpuFeatures& cpu) {
  if (cpu.native_bf16()) return "";
  // Measured by the session that filed issue 33 with scripts/run-comparison.sh on a 2-core
  // AVX2-only AMD EPYC (docs/benchmarks-history.md, "bf16 vs fp32 by CPU class").
  const std::string measured =
      "on a 2-core AVX2-only AMD EPYC, gpt2_train's FSDP bf16 run took 18.9 s/step against "
      "0.8-1.0 s/step for its fp32 runs (19-24x slower)";
  const std::string name =
      (cpu.model.empty() ? "" : cpu.model + ", ") + cpu.arch + " " + cpu.summary();
  const bool x86 = cpu.arch == "x86_64" || cpu.arch == "amd64" || cpu.arch.empty();
  if (!x86) {
    return "dtrain cannot tell whether this CPU (" + name + ") computes bf16 natively: it " +
           "probes x86-64 only (avx512_bf16, amx_bf16). Where bf16 is emulated it is many " +
           "times slower than fp32: " + measured + ". Compare with fp32 before training in bf16.";
  }
  std::string text = "bf16 is emulated on this CPU (" + name +
                     "; no avx512_bf16 or amx_bf16): every bf16 value is converted in software. ";
  if (cpu.avx512f) {
    text += "Its cost on AVX-512 without bf16 has not been measured; " + measured +
            ". Expect fp32 to be faster on this CPU.";
  } else {
    text +=
        "Expect it to be about 20x slower than fp32: " + measured + ". fp32 is faster on this CPU.";
  }
  return text + " bf16 still runs, for its numerics.";
}

CpuFeatures apply_cpu_feature_hooks(CpuFeatures cpu,
                                    const std::map<std::string, std::string>& env) {
  const auto it = env.find(kHideNativeBf16Env);
  const std::string value = it == env.end() ? "" : it->second;
  if (value == "1") {
    cpu.avx512_bf16 = false;
    cpu.amx_bf16 = false;
  } else if (!value.empty() && value != "0") {
    throw std::invalid_argument(std::string(kHideNativeBf16Env) + " must be 0 or 1, got '" + value +
                                "'");
  }
  return cpu;
}

CpuFeatures cpu_features_from_env() {
  std::map<std::string, std::string> env;
  if (const char* v = std::getenv(kHideNativeBf16Env)) env[kHideNativeBf16Env] = v;
  return apply_cpu_feature_hooks(CpuFeatures::detect(), env);
}

}  // namespace dtrain

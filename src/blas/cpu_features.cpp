#include <sys/utsname.h>

#include <cstring>
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
                                                   {avx512_bf16, "bf16"}}) {
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

}  // namespace dtrain

// Identifies the BLAS through its own query functions, looked up at run time: dtrain links
// no BLAS itself (LibTorch does) and must work whichever one is installed.
#include <dlfcn.h>

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/blas.h"

namespace dtrain {
namespace {

using Lookup = std::function<void*(const char*)>;

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

BlasInfo identify(const Lookup& lookup) {
  BlasInfo info;
  using CharFn = char* (*)();
  if (auto* config = reinterpret_cast<CharFn>(lookup("openblas_get_config"))) {
    info.library = "OpenBLAS";
    info.config = config();
    // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY USE_OPENMP Haswell MAX_THREADS=64"
    const std::vector<std::string> w = words(info.config);
    if (w.size() > 1 && w[0] == "OpenBLAS") info.version = w[1];
    for (const auto& word : w) {
      if (word == "DYNAMIC_ARCH") info.dynamic_arch = true;
      if (word == "USE_OPENMP") info.threading = "OpenMP";
    }
    if (auto* corename = reinterpret_cast<CharFn>(lookup("openblas_get_corename"))) {
      info.kernel = corename();
    }
    using IntFn = int (*)();
    if (auto* parallel = reinterpret_cast<IntFn>(lookup("openblas_get_parallel"))) {
      const int p = parallel();
      info.threading = p == 0 ? "sequential" : p == 1 ? "pthreads" : "OpenMP";
    }
    return info;
  }
  using ConstCharFn = const char* (*)();
  if (auto* version = reinterpret_cast<ConstCharFn>(lookup("bli_info_get_version_str"))) {
    info.library = "BLIS";
    info.version = version();
    return info;
  }
  using MklVersionFn = void (*)(char*, int);
  if (auto* version = reinterpret_cast<MklVersionFn>(lookup("MKL_Get_Version_String"))) {
    info.library = "MKL";
    char buffer[256] = {};
    version(buffer, sizeof(buffer));
    info.version = buffer;
    return info;
  }
  return info;
}

}  // namespace

std::string BlasInfo::to_string() const {
  if (library == "unknown") return "unknown BLAS";
  std::string s = library;
  if (!version.empty()) s += " " + version;
  if (!threading.empty()) s += " (" + threading + ")";
  if (!kernel.empty()) s += ", kernel " + kernel;
  return s;
}

BlasInfo BlasInfo::active() {
  return identify([](const char* name) { return dlsym(RTLD_DEFAULT, name); });
}

BlasInfo BlasInfo::probe(const std::string& library) {
  // Kept loaded: unloading OpenBLAS while its thread pool may still be starting is not safe,
  // and a launcher probes once.
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return BlasInfo{};
  return identify([handle](const char* name) { return dlsym(handle, name); });
}

}  // namespace dtrain

// A stand-in for OpenBLAS's query functions, loaded by the BLAS tests (BlasInfo::probe) and by
// dtrain-run's test (--blas_library): it reports the kernel a DYNAMIC_ARCH build would, i.e.
// OPENBLAS_CORETYPE when set, else FAKE_OPENBLAS_KERNEL, else (or when empty) the generic
// "Prescott".
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

namespace {

const char* kernel() {
  for (const char* name : {"OPENBLAS_CORETYPE", "FAKE_OPENBLAS_KERNEL"}) {
    // OpenBLAS falls back to Prescott for an empty OPENBLAS_CORETYPE, too.
    if (const char* v = std::getenv(name)) return *v != '\0' ? v : "Prescott";
  }
  return "Prescott";
}

}  // namespace

extern "C" {

char* openblas_get_corename() {
  static char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%s", kernel());
  return buffer;
}

char* openblas_get_config() {
  static char buffer[160];
  std::snprintf(buffer, sizeof(buffer),
                "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY %s MAX_THREADS=64", kernel());
  return buffer;
}

int openblas_get_parallel() { return 1; }  // pthreads

}  // extern "C"

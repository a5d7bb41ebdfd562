# Locates dtrain's dependencies. Every one comes from a Debian package (see
# scripts/install-deps.sh) or, for LibTorch 2.x, from Torch_DIR; nothing is
# downloaded at configure or build time.

find_package(Torch REQUIRED)
find_package(Gloo REQUIRED)
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)
# Abseil flags: the command lines of dtrain-run and the benchmarks (src/cli), and the examples'.
find_package(absl REQUIRED)

# LibTorch's flags (the C++ ABI switch) must match ours in every TU.
string(APPEND CMAKE_CXX_FLAGS " ${TORCH_CXX_FLAGS}")

set(DTRAIN_HAS_NCCL OFF)
if(NOT DTRAIN_WITH_NCCL STREQUAL "OFF")
  if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_HOME}/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} $ENV{NCCL_HOME}/lib)
  if(CUDAToolkit_FOUND AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(DTRAIN_HAS_NCCL ON)
    if(NOT TARGET dtrain_nccl_imported)
      add_library(dtrain_nccl_imported UNKNOWN IMPORTED)
      set_target_properties(dtrain_nccl_imported PROPERTIES
        IMPORTED_LOCATION "${NCCL_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
    endif()
    message(STATUS "dtrain: NCCL backend ON (${NCCL_LIBRARY}, CUDA ${CUDAToolkit_VERSION})")
  elseif(DTRAIN_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "DTRAIN_WITH_NCCL=ON but CUDA or NCCL was not found")
  else()
    message(STATUS "dtrain: NCCL backend OFF (CUDA or NCCL not found)")
  endif()
endif()

set(DTRAIN_WARNINGS -Wall -Wextra)

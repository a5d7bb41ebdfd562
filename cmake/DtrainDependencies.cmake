# Locates dtrain's dependencies. Every one comes from a Debian package (see
# scripts/install-deps.sh) or, for LibTorch 2.x, from Torch_DIR; nothing is
# downloaded at configure or build time.

find_package(Torch REQUIRED)
find_package(Gloo REQUIRED)
find_package(fmt REQUIRED)
find_package(Threads REQUIRED)
# Abseil flags: the command lines of dtrain-run and the benchmarks (src/cli), and the examples'.
find_package(absl REQUIRED)

# Python's torch wheels bundle fmt and Gloo headers of other versions than the libraries dtrain
# links (torch 2.11: fmt 11, where fmt::join moved to fmt/ranges.h), and LibTorch's include
# directories would come first. Every dtrain target sees the headers of the libraries it links.
foreach(dep IN ITEMS fmt::fmt gloo)
  get_target_property(dep_include ${dep} INTERFACE_INCLUDE_DIRECTORIES)
  if(dep_include)
    include_directories(BEFORE SYSTEM ${dep_include})
  endif()
endforeach()

# LibTorch's flags (the C++ ABI switch) must match ours in every TU, and the other C++
# libraries' too: refuse a LibTorch whose ABI they do not share (cmake/DtrainTorchChecks.cmake).
include(DtrainTorchChecks)
dtrain_check_torch_abi()
string(APPEND CMAKE_CXX_FLAGS " ${TORCH_CXX_FLAGS}")
# The C++ standard: LibTorch's (17, or 20 from LibTorch 2.13), for dtrain's targets and, through
# dtrain::dtrain's compile features, for every consumer (docs/libtorch.md, "C++ standard").
dtrain_torch_cxx_standard(DTRAIN_CXX_STANDARD)
set(CMAKE_CXX_STANDARD ${DTRAIN_CXX_STANDARD})
message(STATUS "dtrain: C++${DTRAIN_CXX_STANDARD} (what LibTorch's headers need)")

set(DTRAIN_HAS_NCCL OFF)
if(NOT DTRAIN_WITH_NCCL STREQUAL "OFF")
  if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  # A CUDA LibTorch that loads NCCL itself decides which NCCL dtrain uses: one NCCL runtime
  # per process (two would each keep their own communicators, threads and CUDA state).
  dtrain_torch_nccl(torch_nccl)
  if(torch_nccl STREQUAL "STATIC")
    message(FATAL_ERROR
      "dtrain: LibTorch's libtorch_cuda.so carries its own NCCL (it exports "
      "ncclCommInitRank and needs no libnccl), so a NCCL library linked by dtrain would be a "
      "second NCCL runtime in the process. Configure with -DDTRAIN_WITH_NCCL=OFF (dtrain's "
      "Gloo backend), or use a LibTorch that links libnccl.so dynamically (Python's torch, "
      "Debian's libtorch-cuda). See docs/libtorch.md.")
  endif()
  set(torch_nccl_include "")
  if(torch_nccl)
    get_filename_component(torch_nccl_dir "${torch_nccl}" DIRECTORY)
    set(torch_nccl_include "${torch_nccl_dir}/../include")  # Python's nvidia/nccl/{lib,include}
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h
    HINTS ${torch_nccl_include} ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_HOME}/include)
  if(torch_nccl AND NOT NCCL_LIBRARY)
    set(NCCL_LIBRARY "${torch_nccl}" CACHE FILEPATH "NCCL library (LibTorch's own)")
  endif()
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} $ENV{NCCL_HOME}/lib)
  if(torch_nccl AND NCCL_LIBRARY)
    get_filename_component(torch_nccl_real "${torch_nccl}" REALPATH)
    get_filename_component(dtrain_nccl_real "${NCCL_LIBRARY}" REALPATH)
    if(NOT torch_nccl_real STREQUAL dtrain_nccl_real)
      message(FATAL_ERROR
        "dtrain: two NCCL libraries. LibTorch loads ${torch_nccl} (${torch_nccl_real}) but "
        "dtrain would link NCCL_LIBRARY=${NCCL_LIBRARY} (${dtrain_nccl_real}); one process "
        "must have one NCCL. Remove NCCL_LIBRARY (dtrain then uses LibTorch's) or set it to "
        "${torch_nccl}. See docs/libtorch.md.")
    endif()
  endif()
  # nccl.h must describe the library linked: compare the header's version with the one in
  # the library's file name where it has one (libnccl.so.2.22.3).
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    get_filename_component(nccl_real "${NCCL_LIBRARY}" REALPATH)
    file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" nccl_defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*"
           "\\1.\\2.\\3" nccl_header_version "${nccl_defs}")
    if(nccl_real MATCHES "libnccl\\.so\\.([0-9]+\\.[0-9]+\\.[0-9]+)$"
       AND NOT CMAKE_MATCH_1 STREQUAL nccl_header_version)
      message(FATAL_ERROR
        "dtrain: ${NCCL_INCLUDE_DIR}/nccl.h is NCCL ${nccl_header_version} but the library is "
        "${nccl_real} (${CMAKE_MATCH_1}). Set NCCL_INCLUDE_DIR to the headers of that NCCL.")
    endif()
  endif()
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

# The MPI backend (Backend::kMpi): MPI's C interface, called from C++ (the project enables no
# C compiler; MPI_CXX_SKIP_MPICXX leaves out the deprecated C++ bindings). Debian:
# libopenmpi-dev or libmpich-dev.
set(DTRAIN_HAS_MPI OFF)
if(NOT DTRAIN_WITH_MPI STREQUAL "OFF")
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    set(DTRAIN_HAS_MPI ON)
    message(STATUS "dtrain: MPI backend ON (MPI ${MPI_CXX_VERSION}, ${MPI_CXX_LIBRARIES})")
  elseif(DTRAIN_WITH_MPI STREQUAL "ON")
    message(FATAL_ERROR "DTRAIN_WITH_MPI=ON but no MPI was found (Debian: libopenmpi-dev)")
  else()
    message(STATUS "dtrain: MPI backend OFF (no MPI found)")
  endif()
endif()

# DTRAIN_WARNINGS and dtrain_no_false_array_bounds (shared with the examples' standalone
# build, examples/CMakeLists.txt).
include(DtrainWarnings)

# Checks that the LibTorch found by find_package(Torch) can share a process with dtrain's
# other dependencies, and refuses at configure time, with what to do, where it cannot
# (instead of an undefined-symbol link error or two NCCL runtimes at run time):
#
#   dtrain_check_torch_abi()   LibTorch's C++ ABI (_GLIBCXX_USE_CXX11_ABI in TORCH_CXX_FLAGS)
#                              must be the one the other C++ libraries dtrain links (Gloo, fmt,
#                              Abseil, GoogleTest: the distribution's, built with the
#                              compiler's default) use. Checked by linking a call into Gloo and
#                              fmt that passes a std::string, compiled with Torch's flag.
#   dtrain_torch_cxx_standard(<var>)
#                              The C++ standard LibTorch's headers need: 17, or 20 where they
#                              refuse C++17 (LibTorch 2.13 and later: "#error C++20 or later
#                              compatible compiler is required to use ATen"). Probed by
#                              compiling <ATen/ATen.h> as C++17, not read from a version
#                              number, so an archive or wheel that differs from its number
#                              is judged by what it does.
#   dtrain_torch_nccl(<var>)   When LibTorch links NCCL dynamically (libtorch_cuda.so NEEDs
#                              libnccl.so.N: Python's torch, Debian's libtorch-cuda), sets
#                              <var> to that library so dtrain uses the same one; empty when
#                              LibTorch has no CUDA or NCCL. When libtorch_cuda.so carries NCCL
#                              inside (exports ncclCommInitRank) sets <var> to "STATIC".

include(CheckCXXSourceCompiles)

function(dtrain_check_torch_abi)
  set(torch_abi "")
  if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])")
    set(torch_abi "${CMAKE_MATCH_1}")
  endif()
  if(torch_abi STREQUAL "")
    return()  # not libstdc++ (or a LibTorch that does not say): nothing to compare
  endif()
  set(probe "
    #include <string>
    #include <fmt/format.h>
    #include <gloo/rendezvous/hash_store.h>
    #include <gloo/rendezvous/prefix_store.h>
    int main(int argc, char**) {
      gloo::rendezvous::HashStore store;
      gloo::rendezvous::PrefixStore prefixed(std::string(argc, 'p'), store);
      return static_cast<int>(fmt::vformat(std::string(argc, 'x'), fmt::make_format_args()).size());
    }")
  set(CMAKE_REQUIRED_QUIET ON)
  set(CMAKE_REQUIRED_LIBRARIES gloo fmt::fmt)
  set(CMAKE_REQUIRED_DEFINITIONS "-D_GLIBCXX_USE_CXX11_ABI=${torch_abi}")
  check_cxx_source_compiles("${probe}" DTRAIN_DEPS_LINK_WITH_TORCH_ABI_${torch_abi})
  if(DTRAIN_DEPS_LINK_WITH_TORCH_ABI_${torch_abi})
    return()
  endif()
  if(torch_abi STREQUAL "0")
    set(other 1)
    set(which "the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0: Python's torch wheels before 2.7, the PyTorch site's \"Pre-cxx11 ABI\" LibTorch archive)")
  else()
    set(other 0)
    set(which "the C++11 ABI (_GLIBCXX_USE_CXX11_ABI=1)")
  endif()
  set(CMAKE_REQUIRED_DEFINITIONS "-D_GLIBCXX_USE_CXX11_ABI=${other}")
  check_cxx_source_compiles("${probe}" DTRAIN_DEPS_LINK_WITH_TORCH_ABI_${other})
  if(DTRAIN_DEPS_LINK_WITH_TORCH_ABI_${other})
    set(deps "were built with _GLIBCXX_USE_CXX11_ABI=${other}")
  else()
    set(deps "do not link with either ABI (see CMakeFiles/CMakeError.log or CMakeConfigureLog.yaml)")
  endif()
  message(FATAL_ERROR
    "dtrain: C++ ABI mismatch. LibTorch (${Torch_DIR}) is built with ${which}, but Gloo "
    "and fmt (and the other C++ libraries dtrain links: Abseil, GoogleTest) ${deps}. "
    "Code compiled with one ABI cannot pass std::string or std::list to code built with the "
    "other; the link or the program would fail. Use a LibTorch built with "
    "_GLIBCXX_USE_CXX11_ABI=${other} (from the PyTorch site: the \"cxx11 ABI\" LibTorch "
    "archive; Python's torch 2.7 and later), or build Gloo, fmt, Abseil and GoogleTest "
    "yourself with -D_GLIBCXX_USE_CXX11_ABI=${torch_abi} and point CMake at them. "
    "See docs/libtorch.md.")
endfunction()

function(dtrain_torch_cxx_standard out)
  # Keyed by LibTorch's include directories: another Torch_DIR in the same build is probed again.
  string(MD5 key "${TORCH_INCLUDE_DIRS}")
  string(SUBSTRING "${key}" 0 8 key)
  set(CMAKE_REQUIRED_QUIET ON)
  set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)  # compile only: the headers decide
  set(CMAKE_REQUIRED_INCLUDES ${TORCH_INCLUDE_DIRS})
  separate_arguments(CMAKE_REQUIRED_DEFINITIONS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  foreach(std IN ITEMS 17 20)
    set(CMAKE_CXX_STANDARD ${std})
    check_cxx_source_compiles("#include <ATen/ATen.h>\nint main() { return 0; }"
                              DTRAIN_TORCH_ACCEPTS_CXX${std}_${key})
    if(DTRAIN_TORCH_ACCEPTS_CXX${std}_${key})
      set(${out} ${std} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  message(FATAL_ERROR
    "dtrain: LibTorch's headers (${TORCH_INCLUDE_DIRS}) compile neither as C++17 nor as C++20 "
    "with ${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}; see CMakeConfigureLog.yaml "
    "(CMake 3.26 and later) or CMakeFiles/CMakeError.log for the compiler's message.")
endfunction()

function(dtrain_torch_nccl out)
  set(${out} "" PARENT_SCOPE)
  set(torch_cuda "")
  if(TARGET torch_cuda)
    get_target_property(torch_cuda torch_cuda LOCATION)
  endif()
  if(NOT torch_cuda)
    find_library(DTRAIN_TORCH_CUDA_LIBRARY torch_cuda HINTS "${TORCH_INSTALL_PREFIX}/lib")
    set(torch_cuda "${DTRAIN_TORCH_CUDA_LIBRARY}")
  endif()
  if(NOT torch_cuda OR NOT EXISTS "${torch_cuda}" OR NOT CMAKE_OBJDUMP)
    return()  # a CPU LibTorch
  endif()
  execute_process(COMMAND "${CMAKE_OBJDUMP}" -p "${torch_cuda}" OUTPUT_VARIABLE dyn
                  ERROR_QUIET RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    return()
  endif()
  get_filename_component(torch_lib_dir "${torch_cuda}" DIRECTORY)
  if(dyn MATCHES "NEEDED[ \t]+(libnccl\\.so[.0-9]*)")
    set(needed "${CMAKE_MATCH_1}")
    # Where the dynamic loader will look first: libtorch_cuda's RUNPATH/RPATH ($ORIGIN is its
    # directory: Python's torch finds nvidia/nccl/lib that way), then the system's paths.
    set(dirs "")
    if(dyn MATCHES "R(UN)?PATH[ \t]+([^\n]*)")
      string(REPLACE "$ORIGIN" "${torch_lib_dir}" rpath "${CMAKE_MATCH_2}")
      string(REPLACE ":" ";" dirs "${rpath}")
    endif()
    list(APPEND dirs "${torch_lib_dir}")
    find_library(DTRAIN_TORCH_NCCL_LIBRARY NAMES "${needed}" HINTS ${dirs})
    if(NOT DTRAIN_TORCH_NCCL_LIBRARY)
      message(FATAL_ERROR
        "dtrain: LibTorch's ${torch_cuda} needs ${needed}, which was not found (searched "
        "${dirs} and the system's paths); dtrain must use the NCCL LibTorch loads.")
    endif()
    set(${out} "${DTRAIN_TORCH_NCCL_LIBRARY}" PARENT_SCOPE)
  elseif(CMAKE_NM)
    execute_process(COMMAND "${CMAKE_NM}" -D --defined-only "${torch_cuda}"
                    OUTPUT_VARIABLE syms ERROR_QUIET)
    if(syms MATCHES "[ \t]T[ \t]+ncclCommInitRank\n")
      set(${out} "STATIC" PARENT_SCOPE)
    endif()
  endif()
endfunction()

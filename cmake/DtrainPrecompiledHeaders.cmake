# Precompiled headers for the targets with many LibTorch-heavy sources.
#
# Parsing LibTorch's headers is most of a dtrain source file's compile: ddp/data_parallel.cpp
# takes 22 s with GCC 12 (15.8 s of it before code generation) and 10 s with a precompiled
# ATen + torch::nn + fmt; 23 s and 13 s with GCC 16 as C++20. Over the library, the tests and
# the GPT-2 trainer that halves a whole build, which is what lets CI's four legs fit their
# time (docs/libtorch.md).
#
#   dtrain_precompile_headers(TARGET [TESTS] [EXCEPT SOURCE...])
#
# TESTS adds GoogleTest and the torch::nn modules and optimizers the tests build models with.
# EXCEPT names TARGET's sources that include no LibTorch header (stores, sockets, JSON, the
# launcher's process code): loading the precompiled header (about 400 MB) costs them 4 s each
# of a 1 s compile. A file missing from that list only compiles slower; one wrongly in it
# compiles as it would without precompiled headers.
# Every source of TARGET then sees these headers first, so a missing #include of one of them
# compiles unnoticed here: -DDTRAIN_PRECOMPILE_HEADERS=OFF builds each file from its own
# includes, and the package tests (tests/package) compile the public headers and the examples
# against an installed dtrain without precompiled headers on every run.
#
# With ccache, CMake's documentation asks for CCACHE_SLOPPINESS=pch_defines,time_macros;
# without it ccache compiles every file (correctly) instead of caching it.
option(DTRAIN_PRECOMPILE_HEADERS
  "Precompile LibTorch's, fmt's and GoogleTest's headers for dtrain's largest targets" ON)

set(DTRAIN_PCH_HEADERS
  <ATen/ATen.h>
  <torch/nn/module.h>
  <fmt/format.h>
  <fmt/ranges.h>
  <algorithm>
  <chrono>
  <functional>
  <map>
  <memory>
  <mutex>
  <optional>
  <string>
  <unordered_map>
  <vector>)
set(DTRAIN_PCH_TEST_HEADERS
  <gtest/gtest.h>
  <torch/nn/modules/container/sequential.h>
  <torch/nn/modules/embedding.h>
  <torch/nn/modules/linear.h>
  <torch/optim/adamw.h>
  <torch/optim/sgd.h>)

function(dtrain_precompile_headers target)
  cmake_parse_arguments(PCH "TESTS" "" "EXCEPT" ${ARGN})
  if(NOT DTRAIN_PRECOMPILE_HEADERS)
    return()
  endif()
  set(headers ${DTRAIN_PCH_HEADERS})
  if(PCH_TESTS)
    list(APPEND headers ${DTRAIN_PCH_TEST_HEADERS})
  endif()
  target_precompile_headers(${target} PRIVATE ${headers})
  if(PCH_EXCEPT)
    set_source_files_properties(${PCH_EXCEPT}
      PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
  endif()
endfunction()

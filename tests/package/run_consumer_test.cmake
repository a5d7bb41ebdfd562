# Installs the already-built dtrain into a fresh prefix, then configures, builds and runs
# a consumer project that only knows find_package(dtrain), and trains it on two ranks with
# the installed dtrain-run. Then the same for README.md's complete example (its first ```cpp
# block that starts with a comment and includes <dtrain/dtrain.h>), which must give each rank
# its own rows and train.
include("${CMAKE_CURRENT_LIST_DIR}/install_and_configure.cmake")
file(READ "${README}" readme)
string(REGEX MATCH "```cpp\n(//[^\n]*\n)+#include <dtrain/dtrain.h>[^`]*```" block "${readme}")
if(NOT block)
  message(FATAL_ERROR "README.md has no complete example (a ```cpp block: comment lines, then "
                      "#include <dtrain/dtrain.h>)")
endif()
string(REGEX REPLACE "^```cpp\n" "" block "${block}")
string(REGEX REPLACE "```$" "" block "${block}")
# Beside WORK_DIR: install_and_configure starts by emptying it.
file(WRITE "${WORK_DIR}-readme_example.cpp" "${block}")
install_and_configure("${CONSUMER_SOURCE_DIR}" consumer
  "-DREADME_EXAMPLE=${WORK_DIR}-readme_example.cpp")
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer build failed: ${rc}")
endif()
# Two ranks, started by the installed launcher as a user would.
execute_process(
  COMMAND "${WORK_DIR}/prefix/bin/dtrain-run" --nproc_per_node 2 -- "${WORK_DIR}/build/consumer"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
message(STATUS "${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer run on two ranks failed: ${rc}")
endif()
if(NOT out MATCHES "rank 0 of 2" OR NOT out MATCHES "rank 1 of 2")
  message(FATAL_ERROR "consumer did not report both ranks")
endif()

# README.md's example on two ranks: each rank its own rows (their first losses differ), and
# training lowers the loss.
execute_process(
  COMMAND "${WORK_DIR}/prefix/bin/dtrain-run" --nproc_per_node 2 -- "${WORK_DIR}/build/readme_example"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
message(STATUS "README example:\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "README example on two ranks failed: ${rc}")
endif()
foreach(r 0 1)
  foreach(step 0 99)
    if(NOT out MATCHES "rank ${r}: step ${step} loss ([0-9.]+)")
      message(FATAL_ERROR "README example: no loss of rank ${r} at step ${step}")
    endif()
    set(loss_${r}_${step} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT loss_${r}_99 LESS loss_${r}_0)
    message(FATAL_ERROR "README example: rank ${r}'s loss did not fall")
  endif()
endforeach()
if(loss_0_0 STREQUAL loss_1_0)
  message(FATAL_ERROR "README example: both ranks had loss ${loss_0_0} at step 0: every rank "
                      "draws the same rows instead of its own part of the global batch")
endif()

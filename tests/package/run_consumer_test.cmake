# Installs the already-built dtrain into a fresh prefix, then configures, builds and runs
# a consumer project that only knows find_package(dtrain), and trains it on two ranks with
# the installed dtrain-run.
include("${CMAKE_CURRENT_LIST_DIR}/install_and_configure.cmake")
install_and_configure("${CONSUMER_SOURCE_DIR}" consumer)
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

# Installs the already-built dtrain into a fresh prefix, then configures, builds and runs
# a consumer project that only knows find_package(dtrain).
include("${CMAKE_CURRENT_LIST_DIR}/install_and_configure.cmake")
install_and_configure("${CONSUMER_SOURCE_DIR}" consumer)
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer build failed: ${rc}")
endif()
execute_process(COMMAND "${WORK_DIR}/build/consumer" RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer run failed: ${rc}")
endif()

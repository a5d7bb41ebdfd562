# Installs the already-built dtrain into a fresh prefix, then configures examples/ alone
# against it (find_package(dtrain), no path into dtrain's source tree but the examples' own)
# and builds the BERT example's library, which compiles the shared example_common with it:
# the examples compile from the installed public headers alone.
include("${CMAKE_CURRENT_LIST_DIR}/install_and_configure.cmake")
install_and_configure("${EXAMPLES_SOURCE_DIR}" examples)
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" --target bert_model
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "examples build (bert_model, example_common) failed: ${rc}")
endif()

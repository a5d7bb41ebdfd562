# Installs the already-built dtrain into a fresh prefix, then configures examples/ alone
# against it (find_package(dtrain), no path into dtrain's source tree but the examples' own)
# and builds the BERT example's library, which compiles the shared example_common with it:
# the examples compile from the installed public headers alone.
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${DTRAIN_BINARY_DIR}" --prefix "${prefix}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S "${EXAMPLES_SOURCE_DIR}" -B "${WORK_DIR}/build"
  -G "${CMAKE_GENERATOR}" "-DCMAKE_PREFIX_PATH=${prefix}" "-DTorch_DIR=${Torch_DIR}"
  -DCMAKE_BUILD_TYPE=Release
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "examples configure failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" --target bert_model
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "examples build (bert_model, example_common) failed: ${rc}")
endif()

# Shared by the package tests: installs the already-built dtrain into a fresh prefix under
# WORK_DIR, then configures SOURCE_DIR against it (find_package(dtrain) only) into
# WORK_DIR/build. WHAT names the project in failure messages; further arguments go to the
# configure step.
function(install_and_configure SOURCE_DIR WHAT)
  file(REMOVE_RECURSE "${WORK_DIR}")
  set(prefix "${WORK_DIR}/prefix")
  execute_process(COMMAND ${CMAKE_COMMAND} --install "${DTRAIN_BINARY_DIR}" --prefix "${prefix}"
    RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install failed: ${rc}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build"
    -G "${CMAKE_GENERATOR}" "-DCMAKE_PREFIX_PATH=${prefix}" "-DTorch_DIR=${Torch_DIR}"
    -DCMAKE_BUILD_TYPE=Release ${ARGN}
    RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${WHAT} configure failed: ${rc}")
  endif()
endfunction()

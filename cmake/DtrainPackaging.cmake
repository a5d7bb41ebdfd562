# Installs dtrain as a CMake package: find_package(dtrain CONFIG) -> dtrain::dtrain.
include(CMakePackageConfigHelpers)

set(DTRAIN_CMAKE_INSTALL_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/dtrain")

install(TARGETS dtrain EXPORT dtrainTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/dtrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES "${PROJECT_BINARY_DIR}/include/dtrain/config.h"
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/dtrain)
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION ${DTRAIN_CMAKE_INSTALL_DIR})

get_target_property(_dtrain_type dtrain TYPE)
set(DTRAIN_STATIC OFF)
if(_dtrain_type STREQUAL "STATIC_LIBRARY")
  set(DTRAIN_STATIC ON)
endif()

configure_package_config_file(cmake/dtrainConfig.cmake.in
  "${PROJECT_BINARY_DIR}/dtrainConfig.cmake"
  INSTALL_DESTINATION ${DTRAIN_CMAKE_INSTALL_DIR})
write_basic_package_version_file("${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/dtrainConfig.cmake"
  "${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake"
  DESTINATION ${DTRAIN_CMAKE_INSTALL_DIR})

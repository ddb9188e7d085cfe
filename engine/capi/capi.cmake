# The shared library libstrata.so and its install rules (C API).
# Only strata_* symbols leave it: capi.cpp is built with hidden visibility and
# exports through STRATA_API, and the version script makes everything else
# local, including what the static engine libraries and their dependencies
# bring along. Until the engine library exists there is nothing to wrap.
if(NOT TARGET strata_engine)
  message(STATUS "C API: strata_engine not defined yet; libstrata.so is not built")
  return()
endif()

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The header's version macros must say what the project says.
file(STRINGS ${PROJECT_SOURCE_DIR}/include/strata/strata.h _strata_ver REGEX "#define STRATA_VERSION_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3" _strata_ver "${_strata_ver}")
if(NOT _strata_ver STREQUAL PROJECT_VERSION)
  message(FATAL_ERROR "include/strata/strata.h says version ${_strata_ver}, the project ${PROJECT_VERSION}")
endif()

# capi.cpp and capi_state.cpp once, for the shared library and for tests that link it statically.
add_library(strata_capi_objects OBJECT ${CMAKE_CURRENT_LIST_DIR}/capi.cpp ${CMAKE_CURRENT_LIST_DIR}/capi_state.cpp)
target_link_libraries(strata_capi_objects PUBLIC strata_engine)
set_target_properties(strata_capi_objects PROPERTIES C_VISIBILITY_PRESET hidden CXX_VISIBILITY_PRESET hidden
                                                     VISIBILITY_INLINES_HIDDEN ON)

set(_strata_map ${CMAKE_CURRENT_LIST_DIR}/strata.map)
add_library(strata SHARED $<TARGET_OBJECTS:strata_capi_objects>)
target_link_libraries(strata PRIVATE strata_engine)
target_include_directories(strata INTERFACE $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                            $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
set_target_properties(strata PROPERTIES
  VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}
  C_VISIBILITY_PRESET hidden CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
  LINK_DEPENDS ${_strata_map}
  INSTALL_RPATH_USE_LINK_PATH ON)  # installed, it still finds what it links from outside the build (CUDA)
target_link_options(strata PRIVATE "LINKER:--version-script=${_strata_map}" "LINKER:--no-undefined"
                    "LINKER:--exclude-libs,ALL")

# Install: the library, the header, a CMake package and a pkg-config file.
install(TARGETS strata EXPORT strataTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/strata/strata.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata)
set(_strata_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${_strata_cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/strataConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/strataConfig.cmake
                              INSTALL_DESTINATION ${_strata_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/strataConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/strataConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/strataConfigVersion.cmake
        DESTINATION ${_strata_cmake_dir})
# strata.pc finds its prefix from its own folder, so the tree installs anywhere
# (cmake --install --prefix DIR) without editing it.
file(RELATIVE_PATH STRATA_PC_TO_PREFIX /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
configure_file(${CMAKE_CURRENT_LIST_DIR}/strata.pc.in ${CMAKE_CURRENT_BINARY_DIR}/strata.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/strata.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

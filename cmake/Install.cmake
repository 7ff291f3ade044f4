# `cmake --install <build> --prefix P`: fsdp.cpp as a CMake package for other projects.
#
#   P/include/{common,device_mesh,sharding,kernels,models,checkpoint,engine,planner,launcher}/...h
#   P/lib/libfsdp_*.a                    the layer libraries
#   P/bin/fsdp                           the CLI (its `fsdp launch` starts any program's ranks)
#   P/lib/cmake/fsdp_cpp/                fsdp_cppConfig.cmake, ...ConfigVersion.cmake, the
#                                        exported targets, and Libtorch.cmake
#
# A user's project:
#   find_package(fsdp_cpp REQUIRED)      # -DCMAKE_PREFIX_PATH=P
#   add_executable(app app.cc)
#   target_link_libraries(app PRIVATE fsdp_cpp::fsdp)
#
# libtorch is not copied: the package records the torch wheel this build used (FSDP_TORCH_DIR)
# and whether it was a CUDA build, and declares the same fsdp::torch targets from it (a user
# may pass another -DFSDP_TORCH_DIR of the same torch version).
include(CMakePackageConfigHelpers)

set(_fsdp_layers fsdp_common fsdp_device_mesh fsdp_sharding fsdp_kernels fsdp_models
                 fsdp_checkpoint fsdp_engine fsdp_planner fsdp_launcher)
if(TARGET fsdp_kernels_cuda)
  list(APPEND _fsdp_layers fsdp_kernels_cuda)
endif()

# fsdp_cpp::fsdp: every layer library. Named fsdp_all here because `fsdp` is the CLI.
add_library(fsdp_all INTERFACE)
set_target_properties(fsdp_all PROPERTIES EXPORT_NAME fsdp)
target_link_libraries(fsdp_all INTERFACE ${_fsdp_layers})
target_compile_features(fsdp_all INTERFACE cxx_std_20)  # the headers use C++20

install(TARGETS ${_fsdp_layers} fsdp_all EXPORT fsdp_cppTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS fsdp RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(_dir common device_mesh sharding kernels models checkpoint engine planner launcher)
  install(DIRECTORY "${PROJECT_SOURCE_DIR}/${_dir}/" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${_dir}"
          FILES_MATCHING PATTERN "*.h")
endforeach()

set(_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/fsdp_cpp")
install(EXPORT fsdp_cppTargets NAMESPACE fsdp_cpp:: DESTINATION "${_cmake_dir}")
set(FSDP_PACKAGE_CUDA_MODE off)
if(FSDP_CUDA)
  set(FSDP_PACKAGE_CUDA_MODE on)
endif()
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/fsdp_cppConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/fsdp_cppConfig.cmake" INSTALL_DESTINATION "${_cmake_dir}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/fsdp_cppConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/fsdp_cppConfig.cmake"
              "${PROJECT_BINARY_DIR}/fsdp_cppConfigVersion.cmake"
              "${PROJECT_SOURCE_DIR}/cmake/Libtorch.cmake"
        DESTINATION "${_cmake_dir}")

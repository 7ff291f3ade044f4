# fsdp_gtest_suites(TARGET [TEST_FILTER negative-filter] LABELS label... TIMEOUT seconds):
# registers one ctest test per GoogleTest suite of TARGET, named after the suite and running
# "TARGET --gtest_filter=Suite.*" (minus TEST_FILTER's negative patterns, e.g. "-*Cuda*").
#
# For the unit binaries, whose hundreds of tests take milliseconds each: gtest_discover_tests
# makes a process per test, and each process spends ~0.45 s loading libtorch (the CUDA wheel's
# libraries included) on the 2-core CI machine, ~60% of those binaries' time in the suite. The
# suites are found when ctest runs, as gtest_discover_tests' PRE_TEST mode finds tests: the
# list is written next to the binary and made again when the binary is newer. A binary not
# built (gpu_check builds the GPU binaries only) shows up as TARGET_NOT_BUILT, without labels.
function(fsdp_gtest_suites target)
  cmake_parse_arguments(arg "" "TEST_FILTER;TIMEOUT" "LABELS" ${ARGN})
  if(arg_TEST_FILTER AND NOT arg_TEST_FILTER MATCHES "^-")
    message(FATAL_ERROR "fsdp_gtest_suites(${target}): TEST_FILTER takes negative patterns "
                        "only (\"-*Cuda*\"), got \"${arg_TEST_FILTER}\"")
  endif()
  set(list_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_tests.cmake")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  file(GENERATE OUTPUT "${include_file}" CONTENT
"set(_fsdp_exe [==[$<TARGET_FILE:${target}>]==])
set(_fsdp_list [==[${list_file}]==])
if(EXISTS \"\${_fsdp_exe}\")
  if(NOT EXISTS \"\${_fsdp_list}\" OR NOT \"\${_fsdp_list}\" IS_NEWER_THAN \"\${_fsdp_exe}\" OR
     NOT \"\${_fsdp_list}\" IS_NEWER_THAN \"\${CMAKE_CURRENT_LIST_FILE}\")
    set(_fsdp_filter [==[${arg_TEST_FILTER}]==])
    set(_fsdp_labels [==[${arg_LABELS}]==])
    set(_fsdp_timeout [==[${arg_TIMEOUT}]==])
    set(_fsdp_workdir [==[${CMAKE_CURRENT_BINARY_DIR}]==])
    include([==[${PROJECT_SOURCE_DIR}/cmake/GTestSuitesList.cmake]==])
  endif()
  include(\"\${_fsdp_list}\")
else()
  add_test([==[${target}_NOT_BUILT]==] [==[${target}_NOT_BUILT]==])
endif()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()

# Run by ctest (cmake/GTestSuites.cmake's include file): lists the suites of _fsdp_exe and
# writes _fsdp_list, one add_test and set_tests_properties per suite.
set(_args --gtest_list_tests)
if(_fsdp_filter)
  list(APPEND _args "--gtest_filter=${_fsdp_filter}")
endif()
execute_process(COMMAND "${_fsdp_exe}" ${_args}
  WORKING_DIRECTORY "${_fsdp_workdir}"
  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 120)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "${_fsdp_exe} --gtest_list_tests failed (${_rc}):\n${_out}\n${_err}")
endif()
string(REPLACE "\n" ";" _lines "${_out}")
set(_script "")
set(_count 0)
foreach(_line IN LISTS _lines)
  # A suite line: "Suite." or "Prefix/Suite/0.  # TypeParam = ...", in the first column; the
  # tests under it are indented.
  if(_line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    set(_suite "${CMAKE_MATCH_1}")
    string(APPEND _script
      "add_test([==[${_suite}]==] [==[${_fsdp_exe}]==] [==[--gtest_filter=${_suite}.*${_fsdp_filter}]==])\n"
      "set_tests_properties([==[${_suite}]==] PROPERTIES LABELS [==[${_fsdp_labels}]==] "
      "TIMEOUT ${_fsdp_timeout} WORKING_DIRECTORY [==[${_fsdp_workdir}]==])\n")
    math(EXPR _count "${_count} + 1")
  endif()
endforeach()
if(_count EQUAL 0)
  message(FATAL_ERROR "${_fsdp_exe} --gtest_list_tests listed no suite:\n${_out}")
endif()
file(WRITE "${_fsdp_list}" "${_script}")

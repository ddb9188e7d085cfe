# strata_add_test(NAME LABEL label SOURCES s... LIBS l... [TIMEOUT s])
# One test binary = one CTest test; exit code 77 means "skipped" (missing
# hardware such as a GPU), which CTest reports as a skip, never a pass.
function(strata_add_test name)
  cmake_parse_arguments(T "" "LABEL;TIMEOUT" "SOURCES;LIBS;ARGS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS})
  add_test(NAME ${name} COMMAND ${name} ${T_ARGS})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABEL}" SKIP_RETURN_CODE 77
                                          TIMEOUT ${T_TIMEOUT})
endfunction()

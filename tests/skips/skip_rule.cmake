# cmake -DFIXTURE_INCLUDE=... -DWORK_DIR=... -DCHECK_SKIPS=... -DCTEST=... -P skip_rule.cmake
#
# Runs the tests of skip_fixtures.cpp under a scratch ctest that includes their
# discovered tests file as built by shardkit_add_test (same properties, same
# test main), and checks the verdict ctest gives each one. Then checks that
# scripts/check-skips accepts that run and rejects a skip without a reason.
foreach(var FIXTURE_INCLUDE WORK_DIR CHECK_SKIPS CTEST)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "skip_rule.cmake: -D${var}=... is required")
  endif()
endforeach()

# ctest's junit status for each test: run (passed), fail, notrun (skipped).
set(expected
  "SuiteWhoseSetUpThrows.AnyTest=fail"
  "Skips.BareGtestSkip=fail"
  "Skips.WithReason=notrun"
  "Skips.WithEmptyReason=fail"
  "Skips.WithReasonAfterAFailure=fail"
  "SkipsInSetUp.WithReason=notrun"
  "Passes.Plainly=run"
  "ForkProbe.ReportsItsProcess=run"
  "ForkProbe.DiesOfTheSignalItIsAsked=run"
  "ForkProbe.SleepsUntilKilledWhenAsked=run")

function(run_scratch_ctest dir testfile_body junit)
  file(REMOVE_RECURSE "${dir}")
  file(MAKE_DIRECTORY "${dir}")
  file(WRITE "${dir}/CTestTestfile.cmake" "${testfile_body}")
  # Non-zero on purpose (tests fail); the junit file says how each one ended.
  execute_process(COMMAND "${CTEST}" --test-dir "${dir}" --output-junit "${junit}"
    OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT EXISTS "${junit}")
    message(FATAL_ERROR "ctest wrote no junit file:\n${out}")
  endif()
  set(ctest_output "${out}" PARENT_SCOPE)
endfunction()

# 1. Every fixture test gets the expected verdict from ctest.
set(rule_dir "${WORK_DIR}/rule")
run_scratch_ctest("${rule_dir}" "include([==[${FIXTURE_INCLUDE}]==])\n" "${WORK_DIR}/rule.xml")
file(READ "${WORK_DIR}/rule.xml" junit)
set(problems "")
foreach(entry IN LISTS expected)
  string(REPLACE "=" ";" pair "${entry}")
  list(GET pair 0 test)
  list(GET pair 1 want)
  string(REPLACE "." "\\." test_re "${test}")
  if(NOT junit MATCHES "<testcase name=\"${test_re}\"[^>]* status=\"([a-z]+)\"")
    string(APPEND problems "  ${test}: not in ctest's results\n")
  elseif(NOT CMAKE_MATCH_1 STREQUAL want)
    string(APPEND problems "  ${test}: ctest says ${CMAKE_MATCH_1}, expected ${want}\n")
  endif()
endforeach()
if(problems)
  message(FATAL_ERROR "skip rule broken:\n${problems}ctest output:\n${ctest_output}")
endif()
message(STATUS "ctest verdicts as expected: ${expected}")

# 2. check-skips accepts that run: both skips there carry their reason.
execute_process(COMMAND "${CHECK_SKIPS}" --ctest "${CTEST}" --build "${rule_dir}"
    --junit "${WORK_DIR}/rule.xml"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check-skips rejected the fixture run (exit ${rc}):\n${out}")
endif()

# 3. ... and rejects a test that ctest skips without a reason (here through
#    SKIP_RETURN_CODE, as an automake-style script test would).
set(bad_dir "${WORK_DIR}/unreasoned")
run_scratch_ctest("${bad_dir}"
  "add_test(exits_77 [==[${CMAKE_COMMAND}]==] -E false)\n\
set_tests_properties(exits_77 PROPERTIES SKIP_RETURN_CODE 1)\n"
  "${WORK_DIR}/unreasoned.xml")
if(NOT ctest_output MATCHES "Skipped")
  message(FATAL_ERROR "the unreasoned scratch test was not skipped by ctest:\n${ctest_output}")
endif()
foreach(mode "--build;${bad_dir}" "--junit;${WORK_DIR}/unreasoned.xml")
  execute_process(COMMAND "${CHECK_SKIPS}" --ctest "${CTEST}" ${mode}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0 OR NOT out MATCHES "exits_77")
    message(FATAL_ERROR "check-skips ${mode} accepted a skip without a reason (exit ${rc}):\n${out}")
  endif()
endforeach()
message(STATUS "check-skips accepts reasoned skips and rejects the rest")

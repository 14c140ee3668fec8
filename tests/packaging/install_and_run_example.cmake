# cmake -P script behind ctest packaging.InstalledPackageBuildsAndRunsTheExample
# (see CMakeLists.txt next to it). Inputs: BUILD_DIR, SOURCE_ROOT, WORK_DIR,
# GENERATOR, CXX_COMPILER, BUILD_TYPE.
#   1. cmake --install BUILD_DIR --prefix WORK_DIR/prefix
#   2. the exported targets name neither the source nor the build tree nor
#      the internal PCH target
#   3. configure examples/checkpoint_basic with CMAKE_PREFIX_PATH=prefix only
#      (warnings are errors), build it, run `checkpoint_basic --nproc 2`
#   4. expect "checkpoint_basic: OK"
#   5. the same for examples/train_basic with find_package(Shardkit): expect
#      "train_basic: OK"
cmake_minimum_required(VERSION 3.18)

foreach(var BUILD_DIR SOURCE_ROOT WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "packaging test: ${var} is not set")
  endif()
endforeach()
if("${BUILD_TYPE}" STREQUAL "")
  set(BUILD_TYPE RelWithDebInfo)
endif()

set(prefix ${WORK_DIR}/prefix)
set(example_build ${WORK_DIR}/example-build)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# Runs a command; on failure stops the test with the command's output.
# Leaves the output in `step_output`.
function(run_step name)
  message(STATUS "packaging: ${name}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "packaging: ${name} failed (${rc}):\n${out}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

run_step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

file(GLOB_RECURSE targets_files ${prefix}/*/shardkitTargets.cmake)
if(NOT targets_files)
  message(FATAL_ERROR "packaging: no shardkitTargets.cmake under ${prefix}")
endif()
foreach(f ${targets_files})
  file(READ ${f} text)
  foreach(leak "${SOURCE_ROOT}/" "${BUILD_DIR}/" "shardkit_pch")
    string(FIND "${text}" "${leak}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "packaging: ${f} refers to '${leak}'; installed targets must not")
    endif()
  endforeach()
endforeach()

run_step("configure the example" ${CMAKE_COMMAND}
  -S ${SOURCE_ROOT}/examples/checkpoint_basic -B ${example_build}
  -G ${GENERATOR}
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
  -DCMAKE_PREFIX_PATH=${prefix}
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
  -DCMAKE_COMPILE_WARNING_AS_ERROR=ON)

# The package must come from the prefix, not from anywhere else.
file(STRINGS ${example_build}/CMakeCache.txt found_dir REGEX "^ShardkitCheckpoint_DIR:")
string(FIND "${found_dir}" "=${prefix}/" at)
if(at EQUAL -1)
  message(FATAL_ERROR "packaging: the example found ShardkitCheckpoint outside ${prefix}: ${found_dir}")
endif()

run_step("build the example" ${CMAKE_COMMAND} --build ${example_build} -j2)

run_step("run the example on 2 ranks" ${example_build}/checkpoint_basic --nproc 2)
message("${step_output}")
if(NOT step_output MATCHES "checkpoint_basic: OK")
  message(FATAL_ERROR "packaging: the example did not print 'checkpoint_basic: OK'")
endif()

# 5. The framework package (Shardkit) from the same prefix: the trainer as a
#    library, examples/train_basic, trained, evaluated, resumed on 2 ranks.
set(train_build ${WORK_DIR}/train-basic-build)
run_step("configure examples/train_basic" ${CMAKE_COMMAND}
  -S ${SOURCE_ROOT}/examples/train_basic -B ${train_build}
  -G ${GENERATOR}
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
  -DCMAKE_PREFIX_PATH=${prefix}
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
  -DCMAKE_COMPILE_WARNING_AS_ERROR=ON)
file(STRINGS ${train_build}/CMakeCache.txt found_dir REGEX "^Shardkit_DIR:")
string(FIND "${found_dir}" "=${prefix}/" at)
if(at EQUAL -1)
  message(FATAL_ERROR "packaging: train_basic found Shardkit outside ${prefix}: ${found_dir}")
endif()
run_step("build examples/train_basic" ${CMAKE_COMMAND} --build ${train_build} -j2)
run_step("run examples/train_basic on 2 ranks" ${train_build}/train_basic --nproc 2)
message("${step_output}")
if(NOT step_output MATCHES "train_basic: OK")
  message(FATAL_ERROR "packaging: examples/train_basic did not print 'train_basic: OK'")
endif()

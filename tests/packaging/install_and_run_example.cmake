# cmake -P script behind ctest packaging.InstalledPackageBuildsAndRunsTheExample
# (see CMakeLists.txt next to it). Inputs: BUILD_DIR, SOURCE_ROOT, WORK_DIR,
# GENERATOR, CXX_COMPILER, CXX_COMPILER_LAUNCHER (the build's ccache launcher,
# cmake/ccache.cmake, its list joined by '|'; empty without one).
#   1. cmake --install BUILD_DIR --prefix WORK_DIR/prefix
#   2. the exported targets name neither the source nor the build tree nor
#      the internal PCH target
#   3. moved headers forward from their old paths; no test seam is installed
#   4. the four examples (checkpoint_basic with find_package(ShardkitCheckpoint);
#      train_basic, fsdp_custom_model and ddp_cnn with find_package(Shardkit))
#      in one build of examples/: configured with CMAKE_PREFIX_PATH=prefix
#      only (warnings are errors), built -j2; each runs `<example> --nproc 2`
#      and must print "<example>: OK"
cmake_minimum_required(VERSION 3.18)

foreach(var BUILD_DIR SOURCE_ROOT WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "packaging test: ${var} is not set")
  endif()
endforeach()

set(prefix ${WORK_DIR}/prefix)
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

# Headers that moved keep their old installed paths as one-line forwarding
# headers (CMakeLists.txt, _moved_headers): each must include a header that
# is installed, and no installed header may include a test-only seam.
set(moved checkpoint/storage/checkpoint_dir.h checkpoint/storage/tiers.h framework/train/options.h)
foreach(old ${moved})
  if(NOT EXISTS ${prefix}/include/shardkit/${old})
    message(FATAL_ERROR "packaging: the moved header's old path ${old} is not installed")
  endif()
  file(READ ${prefix}/include/shardkit/${old} text)
  if(NOT text MATCHES "#include \"([^\"]+)\"")
    message(FATAL_ERROR "packaging: ${old} forwards to nothing:\n${text}")
  endif()
  if(NOT EXISTS ${prefix}/include/shardkit/${CMAKE_MATCH_1})
    message(FATAL_ERROR "packaging: ${old} forwards to ${CMAKE_MATCH_1}, which is not installed")
  endif()
endforeach()
file(GLOB_RECURSE installed_headers ${prefix}/include/shardkit/*.h)
foreach(h ${installed_headers})
  get_filename_component(base ${h} NAME)
  if(base MATCHES "_seam\\.h$")
    message(FATAL_ERROR "packaging: test-only ${h} is installed")
  endif()
endforeach()

# The examples, all four in one build (examples/CMakeLists.txt), configured
# against the prefix alone (warnings are errors); each package must come
# from the prefix. Built with no build type (no optimisation, no debug
# info): what is checked is that the installed headers, targets and
# libraries build and link, and the libraries themselves were optimised
# when they were built.
set(build ${WORK_DIR}/examples-build)
# The launcher goes in an initial cache file: as an argument its list would
# be split on the way (run_step's ARGN).
string(REPLACE "|" ";" launcher "${CXX_COMPILER_LAUNCHER}")
file(WRITE ${WORK_DIR}/launcher.cmake "set(CMAKE_CXX_COMPILER_LAUNCHER \"${launcher}\" CACHE STRING \"\")\n")
run_step("configure examples" ${CMAKE_COMMAND}
  -C ${WORK_DIR}/launcher.cmake
  -S ${SOURCE_ROOT}/examples -B ${build}
  -G ${GENERATOR}
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DCMAKE_BUILD_TYPE=
  -DCMAKE_PREFIX_PATH=${prefix}
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
  -DCMAKE_COMPILE_WARNING_AS_ERROR=ON)
foreach(package ShardkitCheckpoint Shardkit)
  file(STRINGS ${build}/CMakeCache.txt found_dir REGEX "^${package}_DIR:")
  string(FIND "${found_dir}" "=${prefix}/" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "packaging: the examples found ${package} outside ${prefix}: ${found_dir}")
  endif()
endforeach()
run_step("build examples" ${CMAKE_COMMAND} --build ${build} -j2)

# Runs examples/<name> on 2 ranks and expects "<name>: OK".
function(run_example name)
  run_step("run examples/${name} on 2 ranks" ${build}/${name}/${name} --nproc 2)
  message("${step_output}")
  if(NOT step_output MATCHES "${name}: OK")
    message(FATAL_ERROR "packaging: examples/${name} did not print '${name}: OK'")
  endif()
endfunction()

# The checkpoint library alone (package ShardkitCheckpoint).
run_example(checkpoint_basic)
# The framework (package Shardkit): the trainer as a library on the built-in
# model; your own LLaMA-style model with FSDP; a CNN with a frozen
# BatchNorm stem with DDP. Each trains, checkpoints asynchronously, resumes.
run_example(train_basic)
run_example(fsdp_custom_model)
run_example(ddp_cnn)

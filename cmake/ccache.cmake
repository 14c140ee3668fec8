# The compiler cache (Debian's ccache, installed by scripts/bootstrap.sh and in
# the Debian 13 root by scripts/trixie-leg): every compile of this build goes
# through it, so that a fresh clone on a machine that built the same sources
# before (CI runs right after the session that built them, on its machine)
# compiles only what changed. The cache lives outside the clone, in a fixed
# directory (SHARDKIT_CCACHE_DIR, default /var/cache/shardkit/ccache; inside
# the Debian 13 root that path is the root's own, so each leg has its own
# cache). A cold cache changes nothing but the time: a miss runs the compiler.
#
# Why these settings (ccache's manual, "Precompiled headers" and "Compiling
# in different directories"):
#   base_dir = the source tree: absolute paths below it (sources, include
#     dirs, the PCH's -include) are hashed relative to the build directory,
#     so clones in different folders share entries;
#   hash_dir = false: -g1 line tables record the compile directory; hashing it
#     would make every clone miss (the debug info then names the directory of
#     the build that filled the entry);
#   sloppiness pch_defines,time_macros: required to cache compiles that use
#     the precompiled <torch/torch.h> (cmake/torch_pch.cmake), whose .gch is
#     itself cached, so it comes back byte-identical in a fresh clone;
#     include_file_mtime,include_file_ctime: a fresh clone's files are all
#     new, which would otherwise keep them out of the direct mode.
#   -fmacro-prefix-map=<source dir>/=: CMake 3.25's unity sources include
#     each source by its absolute path, which reaches __FILE__ (LibTorch's
#     TORCH_CHECK and c10 macros expand it); mapped away, the preprocessed
#     unit is the same in every clone and ccache's preprocessor mode finds
#     it (its direct mode cannot: the unity file's text names the clone).
#     Messages then name sources relative to the repository (comm/x.cpp).
# Each build directory appends per-compile counters to its own stats log
# (ccache-stats.log); scripts/ccache-stats prints its hit rate, and
# scripts/test prints it for each build with the phase times.
# SHARDKIT_CCACHE=OFF compiles without it (as before).
option(SHARDKIT_CCACHE "Compile through ccache, with the cache outside the clone" ON)
if(SHARDKIT_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(SHARDKIT_CCACHE_PROGRAM ccache)
  if(SHARDKIT_CCACHE_PROGRAM)
    if(DEFINED ENV{SHARDKIT_CCACHE_DIR})
      set(_ccache_dir "$ENV{SHARDKIT_CCACHE_DIR}")
    else()
      set(_ccache_dir /var/cache/shardkit/ccache)
    endif()
    set(SHARDKIT_CCACHE_DIR "${_ccache_dir}" CACHE PATH "Where the compiler cache lives (outside the clone)")
    file(MAKE_DIRECTORY "${SHARDKIT_CCACHE_DIR}")
    set(CMAKE_CXX_COMPILER_LAUNCHER
      ${CMAKE_COMMAND} -E env
        "CCACHE_DIR=${SHARDKIT_CCACHE_DIR}"
        "CCACHE_BASEDIR=${CMAKE_SOURCE_DIR}"
        CCACHE_NOHASHDIR=1
        "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
        CCACHE_MAXSIZE=12G
        "CCACHE_STATSLOG=${CMAKE_BINARY_DIR}/ccache-stats.log"
        ${SHARDKIT_CCACHE_PROGRAM})
    add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fmacro-prefix-map=${CMAKE_SOURCE_DIR}/=>")
    message(STATUS "shardkit: compiling through ccache, cache in ${SHARDKIT_CCACHE_DIR}")
  else()
    message(STATUS "shardkit: ccache not found, compiling without a cache (scripts/bootstrap.sh installs it)")
  endif()
endif()

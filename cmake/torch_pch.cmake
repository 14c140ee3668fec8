# One precompiled header for every target that includes LibTorch: <torch/torch.h>
# costs ~30 s per translation unit on this machine without it. All torch targets
# reuse the PCH of `shardkit_pch`, so they must share its compile flags.
add_library(shardkit_pch STATIC ${CMAKE_SOURCE_DIR}/cmake/pch.cpp)
target_link_libraries(shardkit_pch PUBLIC ${TORCH_LIBRARIES} Threads::Threads)
target_include_directories(shardkit_pch PUBLIC ${CMAKE_SOURCE_DIR})
target_compile_options(shardkit_pch PUBLIC ${SHARDKIT_WARNINGS} ${TORCH_CXX_FLAGS})
if(SHARDKIT_CUDA)
  target_compile_definitions(shardkit_pch PUBLIC SHARDKIT_CUDA=1)
endif()
target_precompile_headers(shardkit_pch PRIVATE <torch/torch.h>)

# libstdc++ before LibTorch in every executable's DT_NEEDED list.
# The pip / pytorch.org LibTorch (2.5 and later) exports copies of statically
# linked libstdc++ symbols, std::filesystem among them, and some of those
# copies are broken: an executable that lists libtorch.so before
# libstdc++.so.6 binds std::filesystem::remove_all & co. to them and jumps to
# address 0 (pytorch/pytorch#133437). The dynamic linker resolves a symbol in
# the first library of the executable's search scope that defines it, so
# naming libstdc++ first on the link line (--no-as-needed, or the linker drops
# it as "not needed yet") makes every such reference bind to the system
# libstdc++. Debian's LibTorch exports no such symbols; there it changes
# nothing. tests/packaging checks the order (readelf) and the bindings
# (LD_DEBUG) on every build. The option is exported with the installed
# targets, so consumers of the package get it too.
# The library is named by its full path (the one the compiler links against):
# a plain -lstdc++ did not reach DT_NEEDED with the pip LibTorch on Ubuntu.
execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
  OUTPUT_VARIABLE SHARDKIT_LIBSTDCXX OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT IS_ABSOLUTE "${SHARDKIT_LIBSTDCXX}")
  set(SHARDKIT_LIBSTDCXX "-lstdc++")
else()
  get_filename_component(SHARDKIT_LIBSTDCXX "${SHARDKIT_LIBSTDCXX}" REALPATH)
endif()
message(STATUS "shardkit: libstdc++ first in DT_NEEDED: ${SHARDKIT_LIBSTDCXX}")
add_library(shardkit_stdcxx_first INTERFACE)
target_link_options(shardkit_stdcxx_first INTERFACE
  "SHELL:-Wl,--push-state,--no-as-needed ${SHARDKIT_LIBSTDCXX} -Wl,--pop-state")
target_link_libraries(shardkit_pch PUBLIC shardkit_stdcxx_first)

# Make `target` a LibTorch target that reuses the shared PCH.
# shardkit_pch is a build detail (its flags must match for REUSE_FROM): it is
# linked only inside this build. Installed targets (see "Installation" in the
# top-level CMakeLists.txt) export LibTorch, Threads and the installed include
# dir instead, so consumers need neither the PCH nor our warning flags.
function(shardkit_torch_target target)
  target_link_libraries(${target} PUBLIC $<BUILD_INTERFACE:shardkit_pch> shardkit_stdcxx_first
    ${TORCH_LIBRARIES} Threads::Threads)
  target_include_directories(${target} PUBLIC $<INSTALL_INTERFACE:include/shardkit>)
  target_precompile_headers(${target} REUSE_FROM shardkit_pch)
endfunction()

#pragma once
// Where a test finds the source tree (configs, fixtures, docs) and the build
// tree (train, ckpt, its scratch directories). Both are read at run time from
// tests/support/paths.cpp, the one small unit compiled with the two absolute
// directories, so that every other test unit compiles to the same bytes in
// every clone and hits the compiler cache (cmake/ccache.cmake).
//
//   const fs::path cfg = fs::path(testing_support::source_dir()) / "configs/default.yaml";
//   const std::string ckpt = testing_support::binary_dir() + "/ckpt";
#include <string>

namespace testing_support {

const std::string& source_dir();  // CMAKE_SOURCE_DIR of the build
const std::string& binary_dir();  // CMAKE_BINARY_DIR of the build

}  // namespace testing_support

// The two directories of tests/support/paths.h: the only unit compiled with
// them (tests/CMakeLists.txt: shardkit_test_paths).
#include "support/paths.h"

namespace testing_support {

const std::string& source_dir() {
  static const std::string dir = SHARDKIT_TEST_SOURCE_DIR;
  return dir;
}

const std::string& binary_dir() {
  static const std::string dir = SHARDKIT_TEST_BINARY_DIR;
  return dir;
}

}  // namespace testing_support

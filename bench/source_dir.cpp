// bench::source_dir() (source_dir.h): the only bench unit compiled with the
// source tree's absolute path (bench/CMakeLists.txt).
#include "bench/source_dir.h"

namespace bench {

const char* source_dir() { return SHARDKIT_SOURCE_DIR; }

}  // namespace bench

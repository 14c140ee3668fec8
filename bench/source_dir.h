#pragma once
// The source tree this build was configured from: where the benchmarks find
// configs/default.yaml. Only bench/source_dir.cpp, a unit without torch, is
// compiled with the absolute path, so the benchmarks' own units compile to
// the same bytes in every clone and hit the compiler cache.
namespace bench {

const char* source_dir();

}  // namespace bench

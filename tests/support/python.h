#pragma once
// The python3 that the tests which run PyTorch itself use: the first of
// $SHARDKIT_PYTHON, /usr/bin/python3 and PATH's python3 that imports the
// given modules (a pip PyTorch lives in its own environment), or "" when none
// does (the caller then skips, saying what it tried, or fails).
//
//   const std::string py = testing_support::python_with("torch");
//   const std::string py = testing_support::python_with(
//       "torch.distributed.checkpoint.state_dict, torch.distributed.tensor");
#include <cstdlib>
#include <string>
#include <vector>

namespace testing_support {

inline std::string python_with(const std::string& modules) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("SHARDKIT_PYTHON")) candidates.push_back(env);
  candidates.push_back("/usr/bin/python3");
  candidates.push_back("python3");
  for (const std::string& python : candidates) {
    const std::string probe = python + " -c 'import " + modules + "' > /dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) return python;
  }
  return "";
}

}  // namespace testing_support

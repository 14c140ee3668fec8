#pragma once
// The python3 that the tests which run PyTorch itself use: the first of
// $SHARDKIT_PYTHON, /usr/bin/python3 and PATH's python3 that has the given
// modules (a pip PyTorch lives in its own environment), or "" when none
// does (the caller then skips, saying what it tried, or fails).
//
//   const std::string py = testing_support::python_with("torch");
//   const std::string py = testing_support::python_with(
//       "torch.distributed.checkpoint.state_dict, torch.distributed.tensor");
//
// The probe finds each module's file without importing it: importing torch
// to ask took 1.5 s on Debian 12 and 3-4 s on Debian 13, in every test that
// asked. A module found there that then fails to import fails the test
// rather than skipping it.
#include <cstdlib>
#include <string>
#include <vector>

namespace testing_support {

inline std::string python_with(const std::string& modules) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("SHARDKIT_PYTHON")) candidates.push_back(env);
  candidates.push_back("/usr/bin/python3");
  candidates.push_back("python3");
  // A dotted name: its top-level package by importlib's finder (not
  // imported), the rest as a package directory or a .py file under it.
  const std::string script =
      "import importlib.util, os, sys\n"
      "for name in sys.argv[1].replace(' ', '').split(','):\n"
      "    top, *rest = name.split('.')\n"
      "    spec = importlib.util.find_spec(top)\n"
      "    if spec is None: sys.exit(1)\n"
      "    if not rest: continue\n"
      "    base = os.path.join((spec.submodule_search_locations or [''])[0], *rest)\n"
      "    if not (os.path.isfile(os.path.join(base, '__init__.py')) or os.path.isfile(base + '.py')):\n"
      "        sys.exit(1)\n";
  for (const std::string& python : candidates) {
    const std::string probe = python + " -c \"" + script + "\" '" + modules + "' > /dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) return python;
  }
  return "";
}

}  // namespace testing_support

#pragma once
// Dataset choice (config section `data`).
#include <string>

namespace framework::data {

struct DataOptions {
  std::string kind = "synthetic";  // synthetic | text
  std::string task = "reverse";    // synthetic task: copy | reverse | add
  std::string path = "";           // text file for kind: text
};

}  // namespace framework::data

#pragma once
// Dataset choice (config section `data`).
#include <string>

namespace framework::data {

struct DataOptions {
  std::string kind = "synthetic";  // synthetic | text
  std::string task = "reverse";    // synthetic task: copy | reverse | add
  std::string path = "";           // text file for kind: text
  // Held out for validation, never trained on. text: this fraction of the
  // file, its tail; synthetic: any value > 0 turns on a separate stream of
  // samples that training never draws. 0: none.
  double eval_fraction = 0.0;
};

}  // namespace framework::data

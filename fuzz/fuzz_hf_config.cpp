// libFuzzer target: a Hugging Face model's config.json, through
// models::read_hf_config_json, which `model.init_from` runs on the file
// (framework/config/config.cpp). Anything it does not read must end in
// std::invalid_argument, the one error its caller catches and names the file
// with; never another exception, a crash or a sanitizer report.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "models/hf_adapter.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    models::read_hf_config_json(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const std::invalid_argument&) {
  }
  return 0;
}

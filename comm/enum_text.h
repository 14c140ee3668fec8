#pragma once
// The text form of the options' enums (config keys whose values are a closed
// set): each options header declares its enum, an array of its values in the
// order the allowed values are named, and to_string (the YAML spelling); its
// one parse function is parse_enum over that array. Torch-free.
#include <cstddef>
#include <stdexcept>
#include <string>

namespace comm {

// The value of `values` whose to_string is `text`. Else throws
// std::invalid_argument naming `key`, the value and the allowed values:
// "checkpoint.mode 'x' is not one of sync, async, overlap".
template <typename Enum, size_t N>
Enum parse_enum(const char* key, const std::string& text, const Enum (&values)[N]) {
  std::string allowed;
  for (Enum value : values) {
    if (text == to_string(value)) return value;
    allowed += (allowed.empty() ? "" : ", ") + std::string(to_string(value));
  }
  throw std::invalid_argument(std::string(key) + " '" + text + "' is not one of " + allowed);
}

}  // namespace comm

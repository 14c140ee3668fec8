#pragma once
// The text form of the options' enums (config keys whose values are a closed
// set): each options header declares its enum and one table of EnumName, its
// values with their YAML spellings in the order the allowed values are named
// (k<Name>s); its to_string is enum_text over that table and its one parse
// function parse_enum over it. Torch-free.
#include <cstddef>
#include <stdexcept>
#include <string>

namespace comm {

// One value of an enum and its spelling. Converts to the value, so a loop
// over a table (for (Backend b : kBackends)) walks the values.
template <typename Enum>
struct EnumName {
  Enum value;
  const char* text;
  constexpr operator Enum() const { return value; }
};

// The spelling of `value` in `names`; "?" for a value the table lacks.
template <typename Enum, size_t N>
constexpr const char* enum_text(Enum value, const EnumName<Enum> (&names)[N]) {
  for (const EnumName<Enum>& name : names)
    if (name.value == value) return name.text;
  return "?";
}

// The value of `names` spelt `text`. Else throws std::invalid_argument naming
// `key`, the value and the allowed values:
// "checkpoint.mode 'x' is not one of sync, async, overlap".
template <typename Enum, size_t N>
Enum parse_enum(const char* key, const std::string& text, const EnumName<Enum> (&names)[N]) {
  std::string allowed;
  for (const EnumName<Enum>& name : names) {
    if (text == name.text) return name.value;
    allowed += (allowed.empty() ? "" : ", ") + std::string(name.text);
  }
  throw std::invalid_argument(std::string(key) + " '" + text + "' is not one of " + allowed);
}

}  // namespace comm

#pragma once
// What a user reads when an operation fails: the exception's message, with
// LibTorch's C++ stack trace cut off (c10::Error appends one to what()).
// SHARDKIT_BACKTRACE=1 keeps the trace, for debugging.
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace checkpoint {

inline bool keep_backtraces() {
  const char* v = std::getenv("SHARDKIT_BACKTRACE");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

inline std::string error_text(const std::exception& e) {
  if (!keep_backtraces()) {
    if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
      return c10_error->what_without_backtrace();
    }
  }
  return e.what();
}

}  // namespace checkpoint

#pragma once
// The schema: one row per config key (dotted path, type, constraint, doc) and
// the value conversions every consumer shares. Internal to framework/config.
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "framework/config/config.h"

namespace framework::config {

enum class ValueType { kInt, kFloat, kBool, kString };

// A key's value, independent of the width of the struct field behind it.
using Value = std::variant<int64_t, double, bool, std::string>;

// Allowed values of a key. Numbers: an optional lower and upper bound (open
// or closed) plus one extra allowed value (the -1 of parallel degrees).
// Strings: a list of choices, or "non-empty", or anything.
struct Constraint {
  std::vector<std::string> choices;
  // Also taken, but not named in messages: the spellings a key took before
  // (checkpoint.direct_io's True and FALSE from when it was a bool).
  std::vector<std::string> also_accepted;
  // Choices known only at run time (model.kind: models::model_kinds()).
  std::vector<std::string> (*choices_of)() = nullptr;
  bool non_empty = false;
  // A string key that also takes a YAML list of names, kept joined by
  // commas (model.lora.targets: [q_proj, v_proj] is "q_proj,v_proj").
  bool list = false;
  std::optional<double> min;
  bool min_open = false;
  std::optional<double> max;
  bool max_open = false;
  std::optional<int64_t> also;
  // A word the YAML may write for `also` ("auto" for 0).
  const char* also_word = nullptr;
  // `also` is spelled only as also_word: the number itself is refused and
  // to_yaml writes the word (checkpoint.interval's auto, kept as -1).
  bool word_only = false;
};

Constraint any_value();
Constraint non_empty();
Constraint names_list(bool non_empty);  // comma-separated names, or a YAML list of them
Constraint one_of(std::vector<std::string> choices);
Constraint one_of_at_run_time(std::vector<std::string> (*choices_of)());
Constraint at_least(double min);
Constraint above(double min);
Constraint between(double min, double max);           // [min, max]
Constraint from_up_to_excl(double min, double max);   // [min, max)
Constraint minus_one_or_at_least(double min);
Constraint auto_or_above(double min);  // 0, written 0 or auto, or > min
Constraint auto_or_at_least(double min);  // auto (kept as -1, written auto), or >= min

struct Key {
  const char* path;  // "checkpoint.compression.level"
  ValueType type;
  Value (*get)(const Config&);
  void (*set)(Config&, const Value&);  // REQUIRES: value passed check_value
  Constraint constraint;
  const char* doc;
};

// Every key, grouped by section, in the order to_yaml writes them.
const std::vector<Key>& schema();

// nullptr when `path` is not a key (it may still be a section).
const Key* find_key(const std::string& path);

// True for "checkpoint" and "checkpoint.compression": prefixes of keys.
bool is_section(const std::string& path);

// The key or section path closest to a misspelled `path`, or "" when none is
// close enough to suggest.
std::string closest_path(const std::string& path);

// Converts the text of a YAML scalar (`is_null`: the value was empty) to the
// key's type and checks its constraint. On success stores into *out and
// returns nullopt; otherwise returns what was wrong, e.g.
// `expected an integer >= 1, got 0`.
std::optional<std::string> parse_value(const Key& key, const std::string& text,
                                       bool is_null, Value* out);

// "an integer >= 1", "one of sync|async|overlap", "true or false", ...
std::string describe_expected(const Key& key);

// The value as YAML text: strings double-quoted, doubles round-trip exactly.
std::string format_value(const Value& value);

// format_value, but a word_only key's `also` as its word ("auto").
std::string format_key_value(const Key& key, const Value& value);

}  // namespace framework::config

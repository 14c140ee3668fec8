#pragma once
// What the command-line tools (ckpt, tokenize, generate) share: parsing
// with their exit statuses. Header-only; needs CLI11, not LibTorch.
#include <CLI/CLI.hpp>

#include <optional>

namespace tools {

// Parses the command line. Returns the exit status when the tool is done
// after it (0 after --help or --version, 2 after a usage error; CLI11 has
// printed the text), nothing when the tool goes on to run.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace tools

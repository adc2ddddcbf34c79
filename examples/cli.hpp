#pragma once
// The examples' and benches' command lines, through CLI11: `--flag value` and `--flag=value`, -h/--help with
// each flag's default, ranges and choices checked. A bad command line prints one line in partir's wording
// ("error: ...", naming the nearest flag when a name looks mistyped) and exits 2, before anything runs.
// CLI11's parser itself is compiled once, in cli.cpp (library partir_cli), not in every program.
#include <CLI/CLI.hpp>

#include <string>

namespace cli {

// A number no smaller than `lo` (CLI::Range's message would print the largest double).
CLI::Validator at_least(double lo);

// CLI::App whose --help shows every default; parse() turns CLI11's errors into partir's wording.
class App : public CLI::App {
 public:
  App(std::string description, std::string name);

  // Parses argv into the declared options; --help prints and exits 0, a bad command line exits 2.
  void parse(int argc, const char* const* argv);

  // The line a bad command line gets ("" when it parses; --help throws CLI::Success).
  std::string problem(int argc, const char* const* argv);
};

}  // namespace cli

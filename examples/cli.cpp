// The examples' and benches' command-line parsing (cli.hpp), compiled once.
#include "cli.hpp"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <vector>

namespace cli {

namespace {

// Edits (insert, delete, substitute) turning a into b.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "; did you mean --steps?" for an unknown "--stpes" (within two edits, or a third of a long name), else "".
std::string suggestion(const CLI::App& app, const std::string& word) {
  if (!word.starts_with("--")) return "";
  const std::string name = word.substr(2, word.find('=') == std::string::npos ? std::string::npos : word.find('=') - 2);
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, name.size() / 3) + 1;
  for (const CLI::Option* o : app.get_options())
    for (const std::string& known : o->get_lnames())
      if (const std::size_t d = edit_distance(name, known); d < best_distance) best = known, best_distance = d;
  return best.empty() ? "" : "; did you mean --" + best + "?";
}

}  // namespace

CLI::Validator at_least(double lo) {
  std::ostringstream bound;
  bound << lo;
  return CLI::Validator(
      [lo, text = bound.str()](std::string& s) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(s.c_str(), &end);
        if (s.empty() || *end) return "expected a number, got '" + s + "'";
        return x < lo ? "expected a number >= " + text + ", got " + s : "";
      },
      ">=" + bound.str());
}

App::App(std::string description, std::string name) : CLI::App(std::move(description), std::move(name)) {
  option_defaults()->always_capture_default();
}

void App::parse(int argc, const char* const* argv) {
  try {
    if (const std::string why = problem(argc, argv); !why.empty()) {
      std::cerr << why << "\n";
      std::exit(2);
    }
  } catch (const CLI::Success& e) {
    std::exit(exit(e));
  }
}

std::string App::problem(int argc, const char* const* argv) {
  try {
    CLI::App::parse(argc, argv);
    return "";
  } catch (const CLI::Success&) {
    throw;
  } catch (const CLI::ParseError& e) {
    std::string why = e.what();
    if (dynamic_cast<const CLI::ExtrasError*>(&e))
      for (const std::string& extra : remaining())
        if (const std::string hint = suggestion(*this, extra); !hint.empty()) {
          why = "unknown flag " + extra + hint;
          break;
        }
    return "error: " + why + " (see --help)";
  }
}

}  // namespace cli

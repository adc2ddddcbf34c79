#pragma once
// A small command-line parser shared by the examples: --flag value pairs, --help from the declared flags.
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace cli {

class Args {
 public:
  Args(int argc, char** argv, std::string usage) : usage_(std::move(usage)) {
    for (int i = 1; i < argc; ++i) raw_.emplace_back(argv[i]);
  }

  // Declares a flag with its default and help text; returns its value.
  std::string get(const std::string& flag, const std::string& fallback, const std::string& help) {
    help_.push_back("  --" + flag + " <value>  " + help + " (default: " + fallback + ")");
    for (std::size_t i = 0; i < raw_.size(); ++i)
      if (raw_[i] == "--" + flag) {
        if (i + 1 >= raw_.size()) fail("--" + flag + " needs a value");
        used_[i] = used_[i + 1] = true;
        return raw_[i + 1];
      }
    return fallback;
  }
  // A flag without a value: true if given.
  bool get_flag(const std::string& flag, const std::string& help) {
    help_.push_back("  --" + flag + "  " + help);
    for (std::size_t i = 0; i < raw_.size(); ++i)
      if (raw_[i] == "--" + flag) return used_[i] = true;
    return false;
  }
  long get_int(const std::string& flag, long fallback, const std::string& help) {
    std::string v = get(flag, std::to_string(fallback), help);
    char* end = nullptr;
    long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end) fail("--" + flag + " expects an integer, got '" + v + "'");
    return n;
  }
  double get_double(const std::string& flag, double fallback, const std::string& help) {
    std::string v = get(flag, std::to_string(fallback), help);
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end) fail("--" + flag + " expects a number, got '" + v + "'");
    return x;
  }

  // Call after every get(): handles --help and rejects unknown flags.
  void finish() {
    for (std::size_t i = 0; i < raw_.size(); ++i) {
      if (raw_[i] == "--help" || raw_[i] == "-h") {
        std::cout << usage_ << "\n\nflags:\n";
        for (const auto& h : help_) std::cout << h << "\n";
        std::exit(0);
      }
      if (!used_[i]) fail("unknown argument '" + raw_[i] + "' (see --help)");
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) {
    std::cerr << "error: " << why << "\n";
    std::exit(2);
  }
  std::string usage_;
  std::vector<std::string> raw_;
  std::map<std::size_t, bool> used_;
  std::vector<std::string> help_;
};

}  // namespace cli

#pragma once
// Selectors name the values a tactic acts on: an exact input name or tag ("x", "params/mlp/h1"), or a glob
// over those names where '*' matches within one path segment and '**' across segments ("params/*/w1",
// "params/**/w1", "params/**"); alternatives separated by '|' select what any of them does
// ("params/**/table|params/**/embed_tokens/weight"). Only inputs and tagged intermediates have names; outputs are reached
// through them (an output that updates an input is tied to it).
#include <algorithm>
#include <string_view>
#include <vector>

#include "partir/ir/program.hpp"

namespace partir {

namespace detail {
inline bool glob_match_one(std::string_view pattern, std::string_view name) {
  if (pattern.empty()) return name.empty();
  if (pattern.starts_with("**")) {
    // "a/**/b" also matches "a/b": '**/' may stand for no segment at all.
    if (pattern.starts_with("**/") && glob_match_one(pattern.substr(3), name)) return true;
    for (std::size_t i = 0; i <= name.size(); ++i)
      if (glob_match_one(pattern.substr(2), name.substr(i))) return true;
    return false;
  }
  if (pattern[0] == '*') {
    for (std::size_t i = 0; i <= name.size(); ++i) {
      if (glob_match_one(pattern.substr(1), name.substr(i))) return true;
      if (i < name.size() && name[i] == '/') break;
    }
    return false;
  }
  return !name.empty() && pattern[0] == name[0] && glob_match_one(pattern.substr(1), name.substr(1));
}
}  // namespace detail

inline bool glob_match(std::string_view pattern, std::string_view name) {
  for (;;) {
    const auto bar = pattern.find('|');
    if (detail::glob_match_one(pattern.substr(0, bar), name)) return true;
    if (bar == std::string_view::npos) return false;
    pattern.remove_prefix(bar + 1);
  }
}

// The named values of a program (inputs and tags), sorted by name so that an exact selector is a lookup and
// a tactic with many selectors stays linear in the program.
class NameIndex {
 public:
  explicit NameIndex(const Program& p) {
    for (ValueId v = 0; v < p.size(); ++v)
      if (!p.op(v).name.empty()) by_name_.emplace_back(p.op(v).name, v);
    std::sort(by_name_.begin(), by_name_.end());
  }

  // The values whose name matches `selector`, in program order.
  std::vector<ValueId> select(std::string_view selector) const {
    if (const auto bar = selector.find('|'); bar != std::string_view::npos) {
      std::vector<ValueId> out = select(selector.substr(0, bar)), rest = select(selector.substr(bar + 1));
      out.insert(out.end(), rest.begin(), rest.end());
      std::sort(out.begin(), out.end());
      out.erase(std::unique(out.begin(), out.end()), out.end());
      return out;
    }
    std::vector<ValueId> out;
    if (selector.find('*') == std::string_view::npos) {
      auto it = std::lower_bound(by_name_.begin(), by_name_.end(), selector,
                                 [](const auto& entry, std::string_view s) { return entry.first < s; });
      for (; it != by_name_.end() && it->first == selector; ++it) out.push_back(it->second);
    } else {
      for (const auto& [name, v] : by_name_)
        if (glob_match(selector, name)) out.push_back(v);
      std::sort(out.begin(), out.end());
    }
    return out;
  }

 private:
  std::vector<std::pair<std::string, ValueId>> by_name_;
};

inline std::vector<ValueId> select(const Program& p, std::string_view selector) { return NameIndex(p).select(selector); }

}  // namespace partir

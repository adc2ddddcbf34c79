#pragma once
// JSON for hardware profiles, reports and traces: nlohmann::ordered_json (objects keep their keys in insertion
// order, so written files are stable and diffable), with partir's errors: malformed text or a missing or
// mistyped member is a UserError naming it.
#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "partir/error.hpp"
#include "partir/sim/json_value.hpp"

namespace partir::json {

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
inline std::string message(const nlohmann::json::exception& e) {
  std::string_view s = e.what();
  if (const auto end = s.find("] "); s.starts_with("[json.exception.") && end != std::string_view::npos)
    s.remove_prefix(end + 2);
  return "json: " + std::string(s);
}

inline Value parse(std::string_view text) {
  try {
    return Value::parse(text);
  } catch (const nlohmann::json::exception& e) {
    user_error(message(e));
  }
}

inline const Value& as_object(const Value& v) {
  if (!v.is_object()) user_error("json: expected an object, got " + v.dump());
  return v;
}
inline const Value& as_array(const Value& v) {
  if (!v.is_array()) user_error("json: expected an array, got " + v.dump());
  return v;
}

// Member `key` of object `v`, nullptr if absent.
inline const Value* find(const Value& v, const std::string& key) {
  as_object(v);
  const auto it = v.find(key);
  return it == v.end() ? nullptr : &*it;
}
inline const Value& at(const Value& v, const std::string& key) {
  if (const Value* m = find(v, key)) return *m;
  user_error("json: object has no member '" + key + "'");
}

// v as a T (a number, an integer that is whole, a string, ...); a mismatch names both.
template <class T>
T get(const Value& v) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    if (v.is_number_float() && v.get<double>() != std::floor(v.get<double>()))
      user_error("json: expected an integer, got " + v.dump());
  try {
    return v.get<T>();
  } catch (const nlohmann::json::exception& e) {
    user_error(message(e));
  }
}

inline Value read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) user_error("cannot open '" + path + "' for reading");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return parse(text.str());
  } catch (const UserError& e) {
    user_error(path + ": " + e.what());
  }
}

// Two-space indented; inf and nan (which JSON lacks) become null.
inline void write_file(const std::string& path, const Value& v) {
  std::ofstream out(path);
  if (!out) user_error("cannot open '" + path + "' for writing");
  out << v.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  if (!out) user_error("cannot write '" + path + "'");
}

}  // namespace partir::json

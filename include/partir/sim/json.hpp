#pragma once
// A small JSON value with a reader and a writer: enough for hardware profiles, reports and traces without
// a new dependency. Objects keep their keys in insertion order, so written files are stable and diffable.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "partir/error.hpp"

namespace partir::json {

class Value {
 public:
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : data_(b) {}
  Value(double x) : data_(x) {}
  Value(int x) : data_(static_cast<double>(x)) {}
  Value(std::int64_t x) : data_(static_cast<double>(x)) {}
  Value(std::string s) : data_(std::move(s)) {}
  Value(std::string_view s) : data_(std::string(s)) {}
  Value(const char* s) : data_(std::string(s)) {}
  Value(Array a) : data_(std::move(a)) {}
  Value(Object o) : data_(std::move(o)) {}

  bool is_null() const { return std::holds_alternative<std::monostate>(data_); }
  bool is_bool() const { return std::holds_alternative<bool>(data_); }
  bool is_number() const { return std::holds_alternative<double>(data_); }
  bool is_string() const { return std::holds_alternative<std::string>(data_); }
  bool is_array() const { return std::holds_alternative<Array>(data_); }
  bool is_object() const { return std::holds_alternative<Object>(data_); }

  bool boolean() const { return get<bool>("a boolean"); }
  double number() const { return get<double>("a number"); }
  std::int64_t integer() const {
    const double x = number();
    if (x != std::floor(x)) user_error("json: expected an integer, got " + dump());
    return static_cast<std::int64_t>(x);
  }
  const std::string& string() const { return get<std::string>("a string"); }
  const Array& array() const { return get<Array>("an array"); }
  const Object& object() const { return get<Object>("an object"); }
  Array& array() { return const_cast<Array&>(std::as_const(*this).array()); }

  // Member `key` of an object, nullptr if absent.
  const Value* find(std::string_view key) const {
    for (const auto& [k, v] : object())
      if (k == key) return &v;
    return nullptr;
  }
  const Value& at(std::string_view key) const {
    if (const Value* v = find(key)) return *v;
    user_error("json: object has no member '" + std::string(key) + "'");
  }
  // Appends a member (objects) or an element (arrays), built in place from v.
  template <class T>
  Value& set(std::string key, T&& v) {
    std::get<Object>(data_).emplace_back(std::piecewise_construct, std::forward_as_tuple(std::move(key)),
                                         std::forward_as_tuple(std::forward<T>(v)));
    return *this;
  }
  template <class T>
  Value& push(T&& v) {
    std::get<Array>(data_).emplace_back(std::forward<T>(v));
    return *this;
  }

  // Compact text with indent < 0; else one member or element per line.
  std::string dump(int indent = -1) const {
    std::string out;
    write(out, indent, 0);
    return out;
  }

  friend bool operator==(const Value&, const Value&) = default;

 private:
  template <class T>
  const T& get(const char* what) const {
    if (const T* v = std::get_if<T>(&data_)) return *v;
    user_error(std::string("json: expected ") + what + ", got " + dump());
  }

  void write(std::string& out, int indent, int depth) const {
    auto newline = [&](int d) {
      if (indent < 0) return;
      out += '\n';
      out.append(static_cast<std::size_t>(indent * d), ' ');
    };
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::monostate>) out += "null";
          else if constexpr (std::is_same_v<T, bool>) out += v ? "true" : "false";
          else if constexpr (std::is_same_v<T, double>) out += number_text(v);
          else if constexpr (std::is_same_v<T, std::string>) out += quote(v);
          else if constexpr (std::is_same_v<T, Array>) {
            out += '[';
            for (std::size_t i = 0; i < v.size(); ++i) {
              if (i) out += ',';
              newline(depth + 1);
              v[i].write(out, indent, depth + 1);
            }
            if (!v.empty()) newline(depth);
            out += ']';
          } else {
            out += '{';
            for (std::size_t i = 0; i < v.size(); ++i) {
              if (i) out += ',';
              newline(depth + 1);
              out += quote(v[i].first);
              out += indent < 0 ? ":" : ": ";
              v[i].second.write(out, indent, depth + 1);
            }
            if (!v.empty()) newline(depth);
            out += '}';
          }
        },
        data_);
  }

 public:
  // Shortest text that reads back to the same double; JSON has no inf or nan, so those become null.
  static std::string number_text(double x) {
    if (!std::isfinite(x)) return "null";
    char buf[32];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
    return std::string(buf, end);
  }
  static std::string quote(std::string_view s) {
    std::string out = "\"";
    for (char c : s) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\t': out += "\\t"; break;
        case '\r': out += "\\r"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
          } else {
            out += c;
          }
      }
    }
    return out + "\"";
  }

 private:
  std::variant<std::monostate, bool, double, std::string, Array, Object> data_;
};

inline Value object() { return Value(Value::Object{}); }
inline Value array() { return Value(Value::Array{}); }

namespace detail {

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Value document() {
    Value v = value();
    skip_space();
    if (pos_ != text_.size()) fail("unexpected text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    user_error("json: " + why + " at offset " + std::to_string(pos_));
  }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\t' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool consume(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail(std::string("expected '") + c + "'");
  }
  bool keyword(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Value value() {
    skip_space();
    if (pos_ >= text_.size()) fail("unexpected end of text");
    const char c = text_[pos_];
    if (c == '{') return object_value();
    if (c == '[') return array_value();
    if (c == '"') return Value(string_value());
    if (keyword("true")) return Value(true);
    if (keyword("false")) return Value(false);
    if (keyword("null")) return Value(nullptr);
    return Value(number_value());
  }

  Value object_value() {
    expect('{');
    Value out = object();
    if (consume('}')) return out;
    do {
      skip_space();
      std::string key = string_value();
      expect(':');
      out.set(std::move(key), value());
    } while (consume(','));
    expect('}');
    return out;
  }

  Value array_value() {
    expect('[');
    Value out = array();
    if (consume(']')) return out;
    do out.push(value());
    while (consume(','));
    expect(']');
    return out;
  }

  std::string string_value() {
    if (pos_ >= text_.size() || text_[pos_] != '"') fail("expected a string");
    ++pos_;
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      char c = text_[pos_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) break;
      switch (char e = text_[pos_++]) {
        case '"': case '\\': case '/': out += e; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': out += unicode_escape(); break;
        default: fail(std::string("unknown escape '\\") + e + "'");
      }
    }
    if (pos_ >= text_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }

  // \uXXXX as UTF-8 (surrogate pairs are not needed by partir's files and are rejected).
  std::string unicode_escape() {
    unsigned code = 0;
    auto [end, ec] = std::from_chars(text_.data() + pos_, text_.data() + std::min(pos_ + 4, text_.size()), code, 16);
    if (ec != std::errc() || end != text_.data() + pos_ + 4) fail("bad \\u escape");
    pos_ += 4;
    if (code >= 0xD800 && code < 0xE000) fail("surrogate \\u escapes are not supported");
    std::string out;
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
    return out;
  }

  double number_value() {
    const std::size_t start = pos_;
    while (pos_ < text_.size() && std::string_view("+-0123456789.eE").find(text_[pos_]) != std::string_view::npos) ++pos_;
    double x = 0;
    auto [end, ec] = std::from_chars(text_.data() + start, text_.data() + pos_, x);
    if (start == pos_ || ec != std::errc() || end != text_.data() + pos_) {
      pos_ = start;
      fail("expected a value");
    }
    return x;
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

}  // namespace detail

inline Value parse(std::string_view text) { return detail::Parser(text).document(); }

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

inline void write_file(const std::string& path, const Value& v) {
  std::ofstream out(path);
  if (!out) user_error("cannot open '" + path + "' for writing");
  out << v.dump(2) << "\n";
  if (!out) user_error("cannot write '" + path + "'");
}

}  // namespace partir::json

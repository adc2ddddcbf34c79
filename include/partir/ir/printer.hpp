#pragma once
// Stable, diffable text form of a Program: one op per line, attributes only where the kind reads them.
#include <cstdio>
#include <ostream>
#include <sstream>
#include <string>

#include "partir/ir/program.hpp"

namespace partir {

namespace detail {

inline std::string list_str(const std::vector<std::int64_t>& v) { return to_string(Shape(v)); }

inline std::string number_str(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

inline std::string attrs_str(const Op& op) {
  const auto& a = op.attrs;
  switch (op.kind) {
    case OpKind::input: {
      std::string s = " {" + std::string(name_of(a.input_kind));
      if (a.input_kind != InputKind::data) {
        static constexpr const char* kinds[] = {"zeros", "ones", "normal", "uniform"};
        s += ", init=" + std::string(kinds[static_cast<int>(a.init.kind)]);
        if (a.init.scale != 0) s += "(" + number_str(a.init.scale) + ")";
      }
      return s + "}";
    }
    case OpKind::constant: {
      std::string s = " {value=";
      if (a.literal.size() == 1) return s + number_str(a.literal[0]) + "}";
      s = " {values=[";
      for (std::size_t i = 0; i < a.literal.size(); ++i) s += (i ? "," : "") + number_str(a.literal[i]);
      return s + "]}";
    }
    case OpKind::dot_general: {
      std::string s = " {";
      if (!a.dot.lhs_batch.empty()) s += "batch=" + list_str(a.dot.lhs_batch) + "x" + list_str(a.dot.rhs_batch) + ", ";
      return s + "contract=" + list_str(a.dot.lhs_contract) + "x" + list_str(a.dot.rhs_contract) + "}";
    }
    case OpKind::reduce_sum:
    case OpKind::reduce_max:
    case OpKind::broadcast_in_dim: return " {dims=" + list_str(a.dims) + "}";
    case OpKind::transpose: return " {perm=" + list_str(a.dims) + "}";
    case OpKind::slice: return " {start=" + list_str(a.lo) + ", limit=" + list_str(a.hi) + "}";
    case OpKind::pad: return " {low=" + list_str(a.lo) + ", high=" + list_str(a.hi) + "}";
    case OpKind::concatenate: return " {axis=" + std::to_string(a.axis) + "}";
    case OpKind::compare: return " {" + std::string(name_of(a.cmp)) + "}";
    case OpKind::convolution:
      return " {strides=" + list_str(a.conv.strides) + ", low=" + list_str(a.lo) + ", high=" + list_str(a.hi) +
             ", lhs_dilation=" + list_str(a.conv.lhs_dilation) + ", rhs_dilation=" + list_str(a.conv.rhs_dilation) +
             (a.conv.feature_groups != 1 ? ", feature_groups=" + std::to_string(a.conv.feature_groups)
                                         : std::string()) +
             (a.conv.flip ? ", flip}" : "}");
    case OpKind::reduce_window_sum:
    case OpKind::reduce_window_max:
    case OpKind::select_and_scatter:
      return " {window=" + list_str(a.window.window) + ", strides=" + list_str(a.window.strides) + ", low=" +
             list_str(a.lo) + ", high=" + list_str(a.hi) + ", base_dilation=" + list_str(a.window.base_dilation) +
             ", window_dilation=" + list_str(a.window.window_dilation) + "}";
    default: return "";
  }
}

}  // namespace detail

inline std::string to_string(const Program& p, ValueId v) {
  const Op& op = p.op(v);
  std::string s = "%" + std::to_string(v);
  if (!op.name.empty()) s += " \"" + op.name + "\"";
  s += " = " + std::string(name_of(op.kind));
  for (std::size_t i = 0; i < op.operands.size(); ++i) s += (i ? ", %" : " %") + std::to_string(op.operands[i]);
  return s + detail::attrs_str(op) + " : " + to_string(op.type);
}

inline std::ostream& operator<<(std::ostream& os, const Program& p) {
  os << "program " << p.name() << " {\n";
  for (ValueId v = 0; v < p.size(); ++v) os << "  " << to_string(p, v) << "\n";
  for (const auto& o : p.outputs()) {
    os << "  output \"" << o.name << "\" = %" << o.value;
    if (!o.updates.empty()) os << " updates \"" << o.updates << "\"";
    os << "\n";
  }
  return os << "}\n";
}

inline std::string to_string(const Program& p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

}  // namespace partir

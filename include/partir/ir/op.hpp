#pragma once
// An Op produces exactly one value; a value is named by the index of the op that produces it (ValueId).
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "partir/ir/tensor_type.hpp"

namespace partir {

using ValueId = std::int32_t;

enum class OpKind : std::uint8_t {
  input, constant,
  // elementwise unary
  neg, exp, log, tanh, rsqrt, sqrt, abs,
  // elementwise binary
  add, sub, mul, div, max, min, pow,
  compare, select,  // compare(a, b) -> 1/0 mask in a's dtype; select(mask, on_true, on_false)
  convert,
  dot_general, reduce_sum, reduce_max,
  broadcast_in_dim, reshape, transpose, slice, pad, concatenate,
  gather, scatter_add,  // embedding lookup along dim 0 of the table, and its transpose
  add_n,  // the sum of any number of same-typed values (a global norm's terms: see sharding/rules.hpp)
  convolution,  // x [N, spatial..., C] (NHWC) with w [window..., C, O] (HWIO) -> [N, spatial'..., O]
  reduce_window_sum, reduce_window_max,  // pooling: a sum or max over a window slid over every dim (WindowDims)
  select_and_scatter,  // (x, g): each window's g added at the first maximum of x in it (max pooling's gradient)
  count_
};

enum class OpClass : std::uint8_t { leaf, unary, binary, other };

struct OpInfo {
  std::string_view name;
  OpClass op_class;
  int arity;  // -1: variadic
};

inline const OpInfo& info(OpKind k) {
  static constexpr std::array<OpInfo, static_cast<std::size_t>(OpKind::count_)> table{{
      {"input", OpClass::leaf, 0},      {"constant", OpClass::leaf, 0},
      {"neg", OpClass::unary, 1},       {"exp", OpClass::unary, 1},
      {"log", OpClass::unary, 1},       {"tanh", OpClass::unary, 1},
      {"rsqrt", OpClass::unary, 1},     {"sqrt", OpClass::unary, 1},
      {"abs", OpClass::unary, 1},       {"add", OpClass::binary, 2},
      {"sub", OpClass::binary, 2},      {"mul", OpClass::binary, 2},
      {"div", OpClass::binary, 2},      {"max", OpClass::binary, 2},
      {"min", OpClass::binary, 2},      {"pow", OpClass::binary, 2},
      {"compare", OpClass::binary, 2},  {"select", OpClass::other, 3},
      {"convert", OpClass::unary, 1},   {"dot_general", OpClass::other, 2},
      {"reduce_sum", OpClass::other, 1}, {"reduce_max", OpClass::other, 1},
      {"broadcast_in_dim", OpClass::other, 1}, {"reshape", OpClass::other, 1},
      {"transpose", OpClass::other, 1}, {"slice", OpClass::other, 1},
      {"pad", OpClass::other, 1},       {"concatenate", OpClass::other, -1},
      {"gather", OpClass::other, 2},    {"scatter_add", OpClass::other, 2},
      {"add_n", OpClass::other, -1},    {"convolution", OpClass::other, 2},
      {"reduce_window_sum", OpClass::other, 1}, {"reduce_window_max", OpClass::other, 1},
      {"select_and_scatter", OpClass::other, 2},
  }};
  return table[static_cast<std::size_t>(k)];
}

inline std::string_view name_of(OpKind k) { return info(k).name; }
// Elementwise ops: every operand has the result's shape, and each output element depends on the
// operands' elements at the same index. convert changes dtype only.
inline bool is_elementwise(OpKind k) {
  auto c = info(k).op_class;
  return c == OpClass::unary || c == OpClass::binary || k == OpKind::select;
}

enum class InputKind : std::uint8_t { data, parameter, optimizer_state };
inline std::string_view name_of(InputKind k) {
  switch (k) {
    case InputKind::data: return "data";
    case InputKind::parameter: return "parameter";
    case InputKind::optimizer_state: return "optimizer_state";
  }
  return "?";
}

enum class CompareDir : std::uint8_t { eq, ne, lt, le, gt, ge };
inline std::string_view name_of(CompareDir d) {
  static constexpr std::array<std::string_view, 6> names{"eq", "ne", "lt", "le", "gt", "ge"};
  return names[static_cast<std::size_t>(d)];
}

// How a parameter or optimizer-state input is initialized by init_inputs(); part of the program so that
// every backend and every shard layout initializes the same global values.
struct Init {
  enum class Kind : std::uint8_t { zeros, ones, normal, uniform, constant } kind = Kind::zeros;
  double scale = 0;  // normal: stddev; uniform: half-width; constant: the value
  friend bool operator==(const Init&, const Init&) = default;
};

struct DotDims {
  std::vector<std::int64_t> lhs_batch, rhs_batch, lhs_contract, rhs_contract;
  friend bool operator==(const DotDims&, const DotDims&) = default;
};

// convolution, per spatial dim (XLA's ConvGeneralDilated with a fixed layout): output position p reads the
// window at p * stride - padding low over the input dilated by lhs_dilation (zeros between its elements; the
// input gradient of a strided convolution), the window's taps rhs_dilation apart. flip reverses the window (a
// true convolution, as the input gradient reads the kernel). Padding (Attrs::lo and hi) may be negative: it
// then crops. With G feature groups (XLA's feature_group_count) the C input features and O output features
// split into G groups, output group g reading input group g only: the kernel is [window..., C / G, O]
// (G = C: depthwise).
struct ConvDims {
  std::vector<std::int64_t> strides, lhs_dilation, rhs_dilation;
  bool flip = false;
  std::int64_t feature_groups = 1;
  friend bool operator==(const ConvDims&, const ConvDims&) = default;
};

// reduce_window_* and select_and_scatter, per operand dim (XLA's ReduceWindow): output position o reduces the
// operand, dilated by base_dilation and padded by Attrs::lo / hi (with the reduction's identity: 0 or -inf),
// at o * stride - lo + t * window_dilation for the window's taps t < window.
struct WindowDims {
  std::vector<std::int64_t> window, strides, base_dilation, window_dilation;
  friend bool operator==(const WindowDims&, const WindowDims&) = default;
};

// One flat attribute record; each op kind reads the fields its comment names.
struct Attrs {
  DotDims dot;                      // dot_general
  ConvDims conv;                    // convolution (padding in lo, hi)
  WindowDims window;                // reduce_window_*, select_and_scatter (padding in lo, hi)
  std::vector<std::int64_t> dims;   // reduce_*: reduced dims; broadcast_in_dim: result dim of each operand
                                    // dim; transpose: permutation (result dim i = operand dim dims[i])
  std::vector<std::int64_t> lo, hi; // slice: start/limit; pad, convolution, windows: low/high padding
  std::int64_t axis = 0;            // concatenate: the joined dim
  Shape shape;                      // broadcast_in_dim, reshape, constant, scatter_add: result shape
  DType dtype = DType::f32;         // convert, constant, input: result dtype
  CompareDir cmp = CompareDir::eq;  // compare
  std::vector<double> literal;      // constant: one value (splat) or one per element, row-major
  InputKind input_kind = InputKind::data;  // input
  Init init;                        // input (parameters and optimizer state)
  friend bool operator==(const Attrs&, const Attrs&) = default;
};

struct Op {
  OpKind kind;
  std::vector<ValueId> operands;
  Attrs attrs;
  TensorType type;   // of the single result
  std::string name;  // input name, or a tag naming an intermediate for tactics ("" if none)
  friend bool operator==(const Op&, const Op&) = default;
};

}  // namespace partir

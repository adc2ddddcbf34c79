#pragma once
// Element access shared by the kernels and the runners: typed pointers into an Array, dispatch on a dtype,
// conversion between element types (16-bit floats included) and the row-index check of gather/scatter.
// No Eigen here: runners include this without the kernels (see eval.hpp).
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "partir/ir/op.hpp"
#include "partir/runtime/kernels/array.hpp"

namespace partir::kernels {

template <class T> const T* ptr(const Array& a) { return a.data<T>().data(); }
template <class T> T* ptr(Array& a) { return a.data<T>().data(); }

// Calls f(T{}) with the element type of t, for kernels that only move elements (any dtype).
template <class F> decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::i32: return f(std::int32_t{});
    case DType::bf16: return f(bf16{});
    case DType::f16: return f(f16{});
  }
  internal_error("unknown dtype");
}

// As visit_dtype, for kernels that compute: 16-bit dtypes reach them widened to f32 (see eval_in_f32).
template <class F> decltype(auto) visit_math_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::i32: return f(std::int32_t{});
    case DType::bf16: case DType::f16: break;
  }
  internal_error("a " + std::string(name_of(t)) + " operand reached an f32/f64/i32 kernel unwidened");
}

// 16-bit floats <-> f32. From f64 (and i32, through f64) the value is first rounded to f32 toward zero with
// the inexact bit kept in the last place ("round to odd"), so that the one rounding to 16 bits is to the
// nearest even, as a direct conversion would be: f32 has more than 2 bits beyond any 16-bit mantissa.
template <class H> float widen(H x) { return static_cast<float>(x); }
template <class H> H narrow(float x) { return H(x); }
template <class H> H narrow(double x) {
  if (std::isnan(x)) return H(std::numeric_limits<float>::quiet_NaN());
  if (std::fabs(x) > std::numeric_limits<float>::max())  // past any 16-bit float's range too
    return H(std::copysign(std::numeric_limits<float>::infinity(), static_cast<float>(x > 0 ? 1 : -1)));
  float f = static_cast<float>(x);
  if (static_cast<double>(f) == x) return H(f);
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  return H(std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u));
}

// out[i] = x[i] converted, for any pair of dtypes (convert's kernel). Float to i32 truncates toward zero.
template <class From, class To>
void convert_elements(const From* x, To* out, std::int64_t n) {
  if constexpr (is_half_type<To>) {
    if constexpr (std::is_same_v<From, float> || is_half_type<From>)
      for (std::int64_t i = 0; i < n; ++i) out[i] = narrow<To>(static_cast<float>(x[i]));
    else
      for (std::int64_t i = 0; i < n; ++i) out[i] = narrow<To>(static_cast<double>(x[i]));
  } else if constexpr (is_half_type<From>) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<To>(widen(x[i]));
  } else {
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<To>(x[i]);
  }
}

// As visit_dtype, for kernels that exist only for floats (GEMM and transcendental math are not built for i32).
template <class F> decltype(auto) visit_float_dtype(DType t, OpKind op, F&& f) {
  if (t == DType::f32) return f(float{});
  if (t == DType::f64) return f(double{});
  user_error(std::string(name_of(op)) + ": i32 operands are not supported, convert them to f32 or f64 first");
}

inline std::int64_t checked_row(std::int32_t index, std::int64_t rows, OpKind op, const TensorType& table) {
  if (index < 0 || index >= rows)
    user_error(std::string(name_of(op)) + ": index " + std::to_string(index) + " is out of range [0, " +
               std::to_string(rows) + ") of " + (op == OpKind::gather ? "table " : "result ") + to_string(table));
  return index;
}

}  // namespace partir::kernels

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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

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

// bf16 <-> f32 sixteen at a time: the integer arithmetic of bf16::from_float and operator float, bit for bit
// (AVX512_BF16's vcvtneps2bf16 is no substitute: it flushes subnormals to zero). The elements from the
// returned index on are left to the caller. Fused 16-bit groups load and store through these (a two-step bf16
// group in cache: 0.33 ns per element against 0.40 with the 256-bit loops GCC made of the scalar code).
inline std::int64_t widen_block16(const bf16* x, float* out, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 16 <= n; i += 16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
  }
#endif
  return i;
}
inline std::int64_t narrow_block16(const float* x, bf16* out, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i one = _mm512_set1_epi32(1), half_ulp = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40),
                magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + i)), high = _mm512_srli_epi32(u, 16);
    const __m512i even = _mm512_add_epi32(half_ulp, _mm512_and_si512(high, one));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, even), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), inf);
    r = _mm512_mask_or_epi32(r, nan, high, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  return i;
}

// out[i] = x[i] converted, for any pair of dtypes (convert's kernel). Float to i32 truncates toward zero.
template <class From, class To>
void convert_elements(const From* x, To* out, std::int64_t n) {
  if constexpr (std::is_same_v<From, float> && std::is_same_v<To, bf16>) {
    for (std::int64_t i = narrow_block16(x, out, n); i < n; ++i) out[i] = To(x[i]);
  } else if constexpr (std::is_same_v<From, bf16> && std::is_same_v<To, float>) {
    for (std::int64_t i = widen_block16(x, out, n); i < n; ++i) out[i] = static_cast<float>(x[i]);
  } else if constexpr (is_half_type<To>) {
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

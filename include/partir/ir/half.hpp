#pragma once
// The 16-bit float types as stored values: bf16 (bfloat16: f32's exponent, 7 mantissa bits) and f16 (IEEE
// binary16). Arithmetic never happens in them: kernels widen to f32, compute, and round back (see
// kernels.hpp), as PyTorch and XLA do on CPUs. Conversions from f32 round to nearest even, keep NaN a (quiet)
// NaN, overflow to infinity and produce subnormals as IEEE 754 says.
#include <bit>
#include <cstdint>
#include <type_traits>

namespace partir {

struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float x) : bits(from_float(x)) {}
  explicit operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
  static bf16 from_bits(std::uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }
  friend bool operator==(bf16, bf16) = default;  // bitwise: for storage, not arithmetic

  static std::uint16_t from_float(float x) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN: quiet
    // Adding 0x7fff plus the kept part's lowest bit rounds half to even; a carry out of the mantissa
    // steps the exponent, up to infinity.
    return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

struct f16 {
  std::uint16_t bits = 0;

  f16() = default;
  explicit f16(float x) : bits(from_float(x)) {}
  explicit operator float() const { return to_float(bits); }
  static f16 from_bits(std::uint16_t b) {
    f16 h;
    h.bits = b;
    return h;
  }
  friend bool operator==(f16, f16) = default;

  // The branch-free conversions of the FP16 library (Maratyszcza): float arithmetic does the rounding.
  static std::uint16_t from_float(float x) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    const std::uint32_t w = std::bit_cast<std::uint32_t>(x), shl1_w = w + w, sign = w & 0x80000000u;
    float base = (std::bit_cast<float>(w & 0x7fffffffu) * scale_to_inf) * scale_to_zero;
    std::uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = std::bit_cast<float>((bias >> 1) + 0x07800000u) + base;
    const std::uint32_t b = std::bit_cast<std::uint32_t>(base);
    const std::uint32_t nonsign = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
    return static_cast<std::uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
  }
  static float to_float(std::uint16_t h) {
    const std::uint32_t w = static_cast<std::uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = std::bit_cast<float>((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
    const float denormalized = std::bit_cast<float>((two_w >> 17) | (126u << 23)) - 0.5f;
    const std::uint32_t magnitude = two_w < (1u << 27) ? std::bit_cast<std::uint32_t>(denormalized)
                                                       : std::bit_cast<std::uint32_t>(normalized);
    return std::bit_cast<float>(sign | magnitude);
  }
};

template <class T> constexpr bool is_half_type = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// a + b in T's arithmetic (f32 for the 16-bit types, rounded once): for collectives and kernels that sum.
template <class T> T plus(T a, T b) {
  if constexpr (is_half_type<T>) return T(static_cast<float>(a) + static_cast<float>(b));
  else return a + b;
}

}  // namespace partir

#pragma once
#include <cstdint>
#include <string_view>

#include "partir/error.hpp"
#include "partir/ir/half.hpp"

namespace partir {

// Element types. Masks from compare are numeric (1/0 in the operand's type), as in PyTorch's float masks:
// one fewer type to carry through every kernel, rule and gradient. bf16 and f16 are storage types (see
// half.hpp): their arithmetic runs in f32.
enum class DType : std::uint8_t { f32, f64, i32, bf16, f16 };

constexpr std::int64_t size_of(DType t) {
  return t == DType::f64 ? 8 : t == DType::bf16 || t == DType::f16 ? 2 : 4;
}
constexpr bool is_float(DType t) { return t != DType::i32; }
constexpr bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "?";
}

inline DType parse_dtype(std::string_view s) {
  if (s == "f32") return DType::f32;
  if (s == "f64") return DType::f64;
  if (s == "i32") return DType::i32;
  if (s == "bf16") return DType::bf16;
  if (s == "f16") return DType::f16;
  user_error("unknown dtype '" + std::string(s) + "' (expected f32, f64, i32, bf16 or f16)");
}

}  // namespace partir

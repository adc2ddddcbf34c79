#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "partir/ir/dtype.hpp"

namespace partir {

using Shape = std::vector<std::int64_t>;

inline std::int64_t num_elements(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

inline std::string to_string(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

struct TensorType {
  Shape shape;
  DType dtype = DType::f32;

  std::int64_t rank() const { return static_cast<std::int64_t>(shape.size()); }
  std::int64_t elements() const { return num_elements(shape); }
  std::int64_t bytes() const { return elements() * size_of(dtype); }
  friend bool operator==(const TensorType&, const TensorType&) = default;
};

// Printed as f32[8,16]; a scalar is f32[].
inline std::string to_string(const TensorType& t) { return std::string(name_of(t.dtype)) + to_string(t.shape); }

}  // namespace partir

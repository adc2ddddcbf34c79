#pragma once
// Row-major strides and the index walk over strided buffers, shared by the CPU kernels and the GPU's
// layout views (no Eigen here).
#include <array>
#include <cstdint>
#include <vector>

#include "partir/ir/tensor_type.hpp"

namespace partir::kernels {

using Strides = std::vector<std::int64_t>;

inline Strides row_major_strides(const Shape& shape) {
  Strides s(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

// Visits every index of `shape` in row-major order and passes body the index's offset in each of N strided
// buffers.
template <std::size_t N, class F>
void for_each_index(const Shape& shape, const std::array<Strides, N>& strides, F&& body) {
  if (num_elements(shape) == 0) return;
  std::vector<std::int64_t> index(shape.size(), 0);
  std::array<std::int64_t, N> offset{};
  for (;;) {
    body(offset);
    for (std::size_t d = shape.size();;) {
      if (d == 0) return;
      --d;
      if (++index[d] < shape[d]) {
        for (std::size_t k = 0; k < N; ++k) offset[k] += strides[k][d];
        break;
      }
      index[d] = 0;
      for (std::size_t k = 0; k < N; ++k) offset[k] -= strides[k][d] * (shape[d] - 1);
    }
  }
}

// Drops size-1 dims and fuses neighbours that are contiguous in every buffer, so that loops run over few,
// long dims (a broadcast row, a whole slice).
template <std::size_t N>
void simplify(Shape& shape, std::array<Strides, N>& strides) {
  Shape fused;
  std::array<Strides, N> fused_strides;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool contiguous = !fused.empty();
    for (std::size_t k = 0; k < N; ++k)
      contiguous = contiguous && fused_strides[k].back() == strides[k][d] * shape[d];
    if (contiguous) fused.back() *= shape[d];
    else fused.push_back(shape[d]);
    for (std::size_t k = 0; k < N; ++k) {
      if (contiguous) fused_strides[k].back() = strides[k][d];
      else fused_strides[k].push_back(strides[k][d]);
    }
  }
  shape = std::move(fused);
  strides = std::move(fused_strides);
}

}  // namespace partir::kernels

#pragma once
// The geometry of a windowed op (ConvDims and WindowDims in op.hpp) and its one index function, shared by the
// CPU kernels (kernels.hpp), the CUDA kernels (gpu/kernels.cuh) and their host-side test. Plain arrays of a
// fixed rank, so the shape passes by value to a CUDA kernel.
#include <cstdint>
#include <string>

#include "partir/ir/op.hpp"

#ifdef __CUDACC__
#define PARTIR_HOST_DEVICE __host__ __device__
#else
#define PARTIR_HOST_DEVICE
#endif

namespace partir::kernels {

inline constexpr int max_window_rank = 8;

// Over `rank` dims (a convolution's spatial dims, every dim of a pooling's operand): output position p reads,
// through tap t, the operand position (p s + t d - lo) / b per dim (stride s, window dilation d, base dilation
// b) where that divides and lies inside; a flipped window takes its taps in reverse. `taps` and `positions`:
// the products of window and out.
struct WindowShape {
  int rank = 0;
  bool flip = false;
  std::int64_t in[max_window_rank] = {}, window[max_window_rank] = {}, out[max_window_rank] = {},
               stride[max_window_rank] = {}, base_dilation[max_window_rank] = {},
               window_dilation[max_window_rank] = {}, lo[max_window_rank] = {};
  std::int64_t taps = 1, positions = 1;
};

// Output position p (row-major over out) through tap t (row-major over window): the operand position it reads
// (row-major over in), or -1 on padding or between dilated elements.
PARTIR_HOST_DEVICE inline std::int64_t window_source(const WindowShape& s, std::int64_t p, std::int64_t t) {
  std::int64_t at = 0, scale = 1;
  for (int d = s.rank - 1; d >= 0; --d) {
    const std::int64_t position = p % s.out[d], index = t % s.window[d];
    p /= s.out[d];
    t /= s.window[d];
    const std::int64_t tap = s.flip ? s.window[d] - 1 - index : index;
    const std::int64_t q = position * s.stride[d] + tap * s.window_dilation[d] - s.lo[d];  // on the dilated operand
    if (q < 0 || q % s.base_dilation[d] != 0 || q / s.base_dilation[d] >= s.in[d]) return -1;
    at += q / s.base_dilation[d] * scale;
    scale *= s.in[d];
  }
  return at;
}

// A convolution's geometry over its spatial dims, a pooling's or select_and_scatter's over every operand dim
// (`out`: the result's or the scattered values' shape).
inline WindowShape window_shape(OpKind kind, const Shape& in, const Shape& window, const Shape& out, const Attrs& a) {
  const bool conv = kind == OpKind::convolution;
  WindowShape s;
  s.rank = static_cast<int>(in.size());
  if (s.rank > max_window_rank)
    user_error(std::string(name_of(kind)) + ": " + std::to_string(s.rank) + " windowed dims exceed the kernels' limit of " +
               std::to_string(max_window_rank));
  s.flip = conv && a.conv.flip;
  for (std::size_t d = 0; d < in.size(); ++d) {
    s.in[d] = in[d], s.window[d] = window[d], s.out[d] = out[d], s.lo[d] = a.lo[d];
    s.stride[d] = conv ? a.conv.strides[d] : a.window.strides[d];
    s.base_dilation[d] = conv ? a.conv.lhs_dilation[d] : a.window.base_dilation[d];
    s.window_dilation[d] = conv ? a.conv.rhs_dilation[d] : a.window.window_dilation[d];
    s.taps *= window[d];
    s.positions *= out[d];
  }
  return s;
}

// x [N, in..., C], w [window..., C / G, O], out [N, out..., O].
inline WindowShape convolution_shape(const Shape& x, const Shape& w, const Shape& out, const Attrs& a) {
  const auto spatial = static_cast<std::ptrdiff_t>(x.size()) - 2;
  return window_shape(OpKind::convolution, Shape(x.begin() + 1, x.end() - 1), Shape(w.begin(), w.begin() + spatial),
                      Shape(out.begin() + 1, out.end() - 1), a);
}

}  // namespace partir::kernels

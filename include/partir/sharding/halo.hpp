#pragma once
// Spatial tiling of a convolution or a pooling window (GSPMD's windowed ops): which dims of one spatial dim tile together, and the
// halo, the rows a tile reads from its neighbours' tiles. Output position o reads the input, dilated by
// lhs_dilation and padded by lo, at o * stride - lo + t * rhs_dilation for the window's taps t. A spatial dim
// tiles in one of two ways:
//   output: the input and the output are tiled alike, the window whole (a forward convolution, an input
//           gradient): output tile p reads input tile p plus a halo; needs O * stride == I * lhs_dilation, so
//           that tiles of both start at the same dilated position;
//   window: the input and the window are tiled alike, the output whole (a kernel gradient, where the window is
//           the output gradient): each device sums the taps of its window tile, a partial sum; needs
//           W * rhs_dilation == I * lhs_dilation.
// The rule (sharding/rules.hpp) links the tiled dims by one factor; lowering (spmd/lower.hpp) brings each tile
// its halo by two collective_permutes between neighbouring tiles and runs the local convolution with the
// padding that makes up the rest.
#include <cstdint>
#include <numeric>
#include <string>

#include "partir/ir/op.hpp"

namespace partir {

enum class SpatialTiling : std::uint8_t { none, output, window };

struct ConvSpatialDim {
  SpatialTiling tiling = SpatialTiling::none;
  std::int64_t input = 0, window = 0, output = 0;  // sizes of the dim in x, w and the result
  // Dilated input positions a tile reads before its first and after its last position (negative: it reads
  // fewer than it holds).
  std::int64_t halo_lo = 0, halo_hi = 0;
  // The size of the factor the tiled dims share: a tile count must divide both.
  std::int64_t shared() const { return std::gcd(input, tiling == SpatialTiling::window ? window : output); }
  friend bool operator==(const ConvSpatialDim&, const ConvSpatialDim&) = default;
};

// One windowed dim: input, window and output sizes, stride, dilations, low padding. `window_may_tile`: the window
// is a tensor (a convolution's kernel), which may then be tiled with the input.
inline ConvSpatialDim spatial_dim(std::int64_t input, std::int64_t window, std::int64_t output, std::int64_t stride,
                                  std::int64_t lhs_dilation, std::int64_t rhs_dilation, std::int64_t lo,
                                  bool window_may_tile) {
  ConvSpatialDim s{SpatialTiling::none, input, window, output, lo, 0};
  const std::int64_t dilated_input = input * lhs_dilation;
  // Where both align (a kernel gradient whose taps are as far apart as its window's positions), the larger
  // of output and window is tiled: it is the one the neighbouring convolutions tile.
  const bool by_output = output * stride == dilated_input;
  const bool by_window = window_may_tile && window * rhs_dilation == dilated_input;
  if (by_output && (!by_window || output >= window)) {
    s.tiling = SpatialTiling::output;
    s.halo_hi = (window - 1) * rhs_dilation + 1 - stride - lo;
  } else if (by_window) {
    s.tiling = SpatialTiling::window;
    s.halo_hi = (output - 1) * stride + 1 - rhs_dilation - lo;
  }
  return s;
}

// Spatial dim d (0-based, of the spatial dims) of convolution `op` with input shape x and kernel shape w.
inline ConvSpatialDim conv_spatial_dim(const Op& op, const Shape& x, const Shape& w, std::size_t d) {
  const ConvDims& c = op.attrs.conv;
  return spatial_dim(x[d + 1], w[d], op.type.shape[d + 1], c.strides[d], c.lhs_dilation[d], c.rhs_dilation[d],
                     op.attrs.lo[d], true);
}

// Dim d of a pooling op (reduce_window_*, select_and_scatter) whose windows have shape `windows` (its result's,
// or select_and_scatter's gradient's). Tiles with the output only, and only without a halo: the padding of a
// max is -inf, which the zeros a halo exchange brings past the ends would not be.
inline ConvSpatialDim window_spatial_dim(const Op& op, const Shape& x, const Shape& windows, std::size_t d) {
  const WindowDims& w = op.attrs.window;
  return spatial_dim(x[d], w.window[d], windows[d], w.strides[d], w.base_dilation[d], w.window_dilation[d],
                     op.attrs.lo[d], false);
}

// What one tile of `rows` input rows does for its halo: receive `from_previous` rows (the previous tile's
// last) and `from_next` rows (the next tile's first), zeros at the ends of the dim, and run the local
// convolution with padding lo and hi on the rows it then holds. With lhs_dilation l, rows are l dilated
// positions apart: the padding adds the holes (zeros) the halo reaches beyond the received rows, or crops
// (negative) what they bring beyond it.
struct HaloExchange {
  std::int64_t from_previous = 0, from_next = 0;
  std::int64_t lo = 0, hi = 0;
  friend bool operator==(const HaloExchange&, const HaloExchange&) = default;
};

inline HaloExchange halo_exchange(const ConvSpatialDim& s, std::int64_t lhs_dilation) {
  // Before the tile, the previous rows sit lhs_dilation, 2 lhs_dilation... positions back (holes between);
  // after it, the next rows sit 0, lhs_dilation... positions past its span (which ends in lhs_dilation - 1 holes).
  HaloExchange h{s.halo_lo > 0 ? s.halo_lo / lhs_dilation : 0,
                 s.halo_hi > 0 ? (s.halo_hi + lhs_dilation - 1) / lhs_dilation : 0, 0, 0};
  h.lo = s.halo_lo - h.from_previous * lhs_dilation;
  h.hi = s.halo_hi + lhs_dilation - 1 - h.from_next * lhs_dilation;
  return h;
}

}  // namespace partir

#pragma once
// The layout ops as strided views: broadcast, transpose, slice, pad, concatenate and the collectives' tile
// moves are each one strided copy (launch::strided_copy), and reductions one ReduceShape. Computing the
// views is host code apart from the launch, so the host-side tests check every view against the CPU
// kernels without a GPU (with the kernels' own index functions from launch.hpp).
#include <algorithm>
#include <string>

#include "partir/runtime/gpu/cuda_error.hpp"
#include "partir/runtime/gpu/launch.hpp"
#include "partir/runtime/kernels/strides.hpp"
#include "partir/runtime/kernels/layout.hpp"

namespace partir::gpu {

using kernels::Strides;

// dst[dst_offset + index . dst] = src[src_offset + index . src] for every index of shape (offsets in elements).
struct View {
  Shape shape;
  Strides src, dst;
  std::int64_t src_offset = 0, dst_offset = 0;
};

// The kernel's form of a view: neighbouring dims that are contiguous on both sides fused, size-1 dims dropped.
inline StridedShape strided(View v) {
  std::array<Strides, 2> strides{std::move(v.src), std::move(v.dst)};
  kernels::simplify(v.shape, strides);
  StridedShape s;
  s.rank = static_cast<int>(v.shape.size());
  if (s.rank > max_rank)
    user_error("gpu: a copy over " + std::to_string(s.rank) + " non-contiguous dims exceeds the kernels' limit of " +
               std::to_string(max_rank));
  for (int d = 0; d < s.rank; ++d) {
    s.shape[d] = v.shape[static_cast<std::size_t>(d)];
    s.src[d] = strides[0][static_cast<std::size_t>(d)];
    s.dst[d] = strides[1][static_cast<std::size_t>(d)];
  }
  return s;
}

inline void copy(const View& v, const void* src, void* dst, DType t, cudaStream_t stream) {
  if (num_elements(v.shape) == 0) return;
  const auto bytes = size_of(t);
  launch::strided_copy(static_cast<int>(bytes), strided(v), static_cast<const std::byte*>(src) + v.src_offset * bytes,
                       static_cast<std::byte*>(dst) + v.dst_offset * bytes, stream);
}

inline View broadcast_view(const Shape& x, const Attrs& a) {
  const Strides xs = kernels::row_major_strides(x);
  Strides src(a.shape.size(), 0);  // new dims and expanded size-1 dims re-read the same elements
  for (std::size_t i = 0; i < a.dims.size(); ++i)
    if (x[i] != 1) src[static_cast<std::size_t>(a.dims[i])] = xs[i];
  return {a.shape, src, kernels::row_major_strides(a.shape)};
}

inline View transpose_view(const Shape& x, const Attrs& a, const Shape& out) {
  const Strides xs = kernels::row_major_strides(x);
  Strides src;
  for (auto d : a.dims) src.push_back(xs[static_cast<std::size_t>(d)]);
  return {out, src, kernels::row_major_strides(out)};
}

inline View slice_view(const Shape& x, const Attrs& a, const Shape& out) {
  const Strides xs = kernels::row_major_strides(x);
  std::int64_t start = 0;
  for (std::size_t d = 0; d < xs.size(); ++d) start += a.lo[d] * xs[d];
  return {out, xs, kernels::row_major_strides(out), start, 0};
}

// Writes x into the zeroed result.
inline View pad_view(const Shape& x, const Attrs& a, const Shape& out) {
  const Strides os = kernels::row_major_strides(out);
  std::int64_t start = 0;
  for (std::size_t d = 0; d < os.size(); ++d) start += a.lo[d] * os[d];
  return {x, kernels::row_major_strides(x), os, 0, start};
}

// Part `part` of a concatenation along `axis`, whose earlier parts span `at` indices of it.
inline View concatenate_view(const Shape& part, std::int64_t axis, std::int64_t at, const Shape& out) {
  const Strides os = kernels::row_major_strides(out);
  return {part, kernels::row_major_strides(part), os, 0, at * os[static_cast<std::size_t>(axis)]};
}

// Tile `index` of `tiles` along `dim` (all_slice).
inline View tile_view(const Shape& shape, std::int64_t dim, std::int64_t tiles, std::int64_t index) {
  const auto s = layout::split(shape, dim, 1);
  const std::int64_t chunk = s.n / tiles * s.inner;
  return {{s.outer, chunk}, {s.n * s.inner, 1}, {chunk, 1}, index * chunk, 0};
}

// Tile q of `tiles` along `dim` to the q-th contiguous block (to_blocks: layout::pack), or back (unpack).
inline View tiles_view(const Shape& shape, std::int64_t dim, std::int64_t tiles, bool to_blocks) {
  const auto s = layout::split(shape, dim, 1);
  const std::int64_t chunk = s.n / tiles * s.inner;
  const Strides laid_out{chunk, s.n * s.inner, 1}, blocks{s.outer * chunk, chunk, 1};
  return {{tiles, s.outer, chunk}, to_blocks ? laid_out : blocks, to_blocks ? blocks : laid_out};
}

// Tiles along `dim` are already contiguous blocks when every dim before it has size 1.
inline bool tiles_are_blocks(const Shape& shape, std::int64_t dim) { return layout::split(shape, dim, 1).outer == 1; }

// Neighbouring non-unit dims on the same side are fused into one (row-major: the outer one's stride is
// the inner one's times its size), so the kernels' index arithmetic divides once per side in the common
// cases (reduce the last dims, reduce the leading dims, reduce everything).
inline ReduceShape reduce_shape(const Shape& x, const std::vector<std::int64_t>& dims, OpKind kind) {
  const Strides xs = kernels::row_major_strides(x);
  ReduceShape s;
  int last_side = -1;  // side of the previous non-unit dim: 1 reduced, 0 kept
  for (std::size_t d = 0; d < x.size(); ++d) {
    const bool reduced = std::find(dims.begin(), dims.end(), static_cast<std::int64_t>(d)) != dims.end();
    if (x[d] == 1) continue;  // contributes nothing to either side
    int& rank = reduced ? s.reduced_rank : s.kept_rank;
    std::int64_t* sizes = reduced ? s.reduced : s.kept;
    std::int64_t* strides = reduced ? s.reduced_stride : s.kept_stride;
    (reduced ? s.count : s.outputs) *= x[d];
    if (last_side == static_cast<int>(reduced)) {  // adjacent in memory: fuse with the previous dim
      sizes[rank - 1] *= x[d];
      strides[rank - 1] = xs[d];
      continue;
    }
    last_side = static_cast<int>(reduced);
    if (rank == max_rank)
      user_error(std::string(name_of(kind)) + ": operand rank " + std::to_string(x.size()) +
                 " exceeds the GPU kernels' limit of " + std::to_string(max_rank) + " non-unit dims per side");
    sizes[rank] = x[d];
    strides[rank] = xs[d];
    ++rank;
  }
  return s;
}

}  // namespace partir::gpu

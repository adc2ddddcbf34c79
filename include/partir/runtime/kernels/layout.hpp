#pragma once
// Moving tiles of a row-major tensor between its layout and contiguous blocks: what collectives need when
// the dim they act on is not the leading one. Byte-level, so one code path serves every dtype.
#include <algorithm>
#include <cstring>

#include "partir/mesh.hpp"
#include "partir/runtime/kernels/array.hpp"
#include "partir/runtime/kernels/buffer_cache.hpp"
#include "partir/sharding/sharding.hpp"

namespace partir::layout {

struct Split {
  std::int64_t outer, n, inner;  // elements before `dim`, the dim's size, bytes after it (per index)
};
inline Split split(const Shape& shape, std::int64_t dim, std::int64_t element_bytes) {
  Split s{1, shape.at(static_cast<std::size_t>(dim)), element_bytes};
  for (std::int64_t d = 0; d < dim; ++d) s.outer *= shape[static_cast<std::size_t>(d)];
  for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < shape.size(); ++d) s.inner *= shape[d];
  return s;
}

inline std::byte* bytes(Array& a) {
  return std::visit([](auto& v) { return reinterpret_cast<std::byte*>(v.data()); }, a.storage());
}
inline const std::byte* bytes(const Array& a) {
  return std::visit([](const auto& v) { return reinterpret_cast<const std::byte*>(v.data()); }, a.storage());
}

// Tile `index` of `tiles` equal tiles of `in` along `dim`.
inline Array tile(const Array& in, std::int64_t dim, std::int64_t tiles, std::int64_t index) {
  Shape shape = in.shape();
  shape[static_cast<std::size_t>(dim)] /= tiles;
  Array out = kernels::buffer_cache().take(TensorType{shape, in.dtype()});  // every byte is written below
  const auto s = split(in.shape(), dim, size_of(in.dtype()));
  const std::int64_t t = s.n / tiles;
  const auto chunk = static_cast<std::size_t>(t * s.inner);
  for (std::int64_t o = 0; o < s.outer; ++o)
    std::memcpy(bytes(out) + o * t * s.inner, bytes(in) + (o * s.n + index * t) * s.inner, chunk);
  return out;
}

// Whether the tiles along `dim` already are contiguous blocks (no dim before it has more than one index):
// then pack and unpack are plain copies, and a collective can read or write the tensor itself.
inline bool tiles_are_blocks(const Shape& shape, std::int64_t dim) {
  return std::all_of(shape.begin(), shape.begin() + dim, [](std::int64_t d) { return d == 1; });
}

// Reorders `in` so that tile q along `dim` is the q-th contiguous block (send layout).
inline void pack(const Array& in, std::int64_t dim, std::int64_t tiles, std::byte* out) {
  const auto s = split(in.shape(), dim, size_of(in.dtype()));
  const std::int64_t t = s.n / tiles;
  const auto chunk = static_cast<std::size_t>(t * s.inner);
  for (std::int64_t q = 0; q < tiles; ++q)
    for (std::int64_t o = 0; o < s.outer; ++o)
      std::memcpy(out + (q * s.outer + o) * t * s.inner, bytes(in) + (o * s.n + q * t) * s.inner, chunk);
}

// The inverse: contiguous blocks (receive layout) concatenated along `dim` into `out`.
inline void unpack(const std::byte* in, std::int64_t dim, std::int64_t tiles, Array& out) {
  const auto s = split(out.shape(), dim, size_of(out.dtype()));
  const std::int64_t t = s.n / tiles;
  const auto chunk = static_cast<std::size_t>(t * s.inner);
  for (std::int64_t q = 0; q < tiles; ++q)
    for (std::int64_t o = 0; o < s.outer; ++o)
      std::memcpy(bytes(out) + (o * s.n + q * t) * s.inner, in + (q * s.outer + o) * t * s.inner, chunk);
}

// Where this device's piece of a value of shape `global` sits: the global index of its first element per dim.
inline std::vector<std::int64_t> piece_offset(const Shape& global, const Sharding& sharding, const Mesh& mesh,
                                              std::int64_t device) {
  std::vector<std::int64_t> offset(global.size(), 0);
  for (std::size_t d = 0; d < global.size(); ++d)
    if (!sharding.dims[d].empty())
      offset[d] = mesh.position(device, sharding.dims[d]) * (global[d] / tile_count(sharding.dims[d], mesh));
  return offset;
}

// A box of shape `box` at `offset` in a row-major value of shape `whole`: the flat index in `whole` of the
// first element of the box's row r (rows run along the last dim).
inline std::int64_t row_start(const Shape& box, std::int64_t r, const Shape& whole, const std::vector<std::int64_t>& offset) {
  std::int64_t at = 0, scale = 1;
  for (std::size_t d = box.size(); d-- > 0;) {
    std::int64_t index = 0;
    if (d + 1 != box.size()) {
      index = r % box[d];
      r /= box[d];
    }
    at += (index + offset[d]) * scale;
    scale *= whole[d];
  }
  return at;
}

inline std::int64_t row_count(const Shape& box) {
  std::int64_t rows = box.empty() || box.back() > 0 ? 1 : 0;
  for (std::size_t d = 0; d + 1 < box.size(); ++d) rows *= box[d];
  return rows;
}

// run(local, global, n) for every contiguous run (a row along the last dim) of a piece of shape `piece` at
// `offset` in a row-major value of shape `global`: the flat index of the run's first element in each, and
// its length.
template <class Run>
void for_each_run(const Shape& piece, const Shape& global, const std::vector<std::int64_t>& offset, Run&& run) {
  const std::int64_t row = piece.empty() ? 1 : piece.back();
  for (std::int64_t r = 0, rows = row_count(piece); r < rows; ++r) run(r * row, row_start(piece, r, global, offset), row);
}

// Two pieces of one value, at offsets `from_at` and `to_at` of it: copies the elements they share from
// `from` into `to` (nothing if they do not overlap).
inline void copy_overlap(const Array& from, const std::vector<std::int64_t>& from_at, Array& to,
                         const std::vector<std::int64_t>& to_at) {
  const std::size_t rank = from.shape().size();
  Shape box(rank);
  std::vector<std::int64_t> in_from(rank), in_to(rank);
  for (std::size_t d = 0; d < rank; ++d) {
    const std::int64_t lo = std::max(from_at[d], to_at[d]);
    const std::int64_t hi = std::min(from_at[d] + from.shape()[d], to_at[d] + to.shape()[d]);
    if (hi <= lo) return;
    box[d] = hi - lo;
    in_from[d] = lo - from_at[d];
    in_to[d] = lo - to_at[d];
  }
  const auto width = static_cast<std::size_t>(size_of(from.dtype()));
  const std::int64_t row = rank ? box.back() : 1;
  for (std::int64_t r = 0, rows = row_count(box); r < rows; ++r)
    std::memcpy(bytes(to) + static_cast<std::size_t>(row_start(box, r, to.shape(), in_to)) * width,
                bytes(from) + static_cast<std::size_t>(row_start(box, r, from.shape(), in_from)) * width,
                static_cast<std::size_t>(row) * width);
}

// This device's piece of a global value laid out by `sharding` (partial-sum axes: the piece is the value
// itself on position 0 of those axes and zeros elsewhere, so the pieces sum to the value).
inline Array shard(const Array& global, const Sharding& sharding, const Mesh& mesh, std::int64_t device) {
  Array piece = global;
  for (std::size_t d = 0; d < sharding.dims.size(); ++d) {
    const auto& axes = sharding.dims[d];
    if (axes.empty()) continue;
    piece = tile(piece, static_cast<std::int64_t>(d), tile_count(axes, mesh), mesh.position(device, axes));
  }
  if (!sharding.partial.empty() && mesh.position(device, sharding.partial) != 0)
    std::memset(bytes(piece), 0, static_cast<std::size_t>(piece.bytes()));
  return piece;
}

}  // namespace partir::layout

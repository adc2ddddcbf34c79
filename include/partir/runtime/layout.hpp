#pragma once
// Moving tiles of a row-major tensor between its layout and contiguous blocks: what collectives need when
// the dim they act on is not the leading one. Byte-level, so one code path serves every dtype.
#include <cstring>

#include "partir/mesh.hpp"
#include "partir/runtime/array.hpp"
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
  Array out(TensorType{shape, in.dtype()});
  const auto s = split(in.shape(), dim, size_of(in.dtype()));
  const std::int64_t t = s.n / tiles;
  const auto chunk = static_cast<std::size_t>(t * s.inner);
  for (std::int64_t o = 0; o < s.outer; ++o)
    std::memcpy(bytes(out) + o * t * s.inner, bytes(in) + (o * s.n + index * t) * s.inner, chunk);
  return out;
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

// run(local, global, n) for every contiguous run (a row along the last dim) of a piece of shape `piece` at
// `offset` in a row-major value of shape `global`: the flat index of the run's first element in each, and
// its length.
template <class Run>
void for_each_run(const Shape& piece, const Shape& global, const std::vector<std::int64_t>& offset, Run&& run) {
  const std::size_t rank = piece.size();
  const std::int64_t row = rank ? piece[rank - 1] : 1;
  std::int64_t rows = row ? 1 : 0;
  for (std::size_t d = 0; d + 1 < rank; ++d) rows *= piece[d];
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t rest = r, at = 0, scale = 1;
    for (std::size_t d = rank; d-- > 0;) {  // the global flat index, last dim first
      const std::int64_t index = d + 1 == rank ? 0 : rest % piece[d];
      if (d + 1 != rank) rest /= piece[d];
      at += (index + offset[d]) * scale;
      scale *= global[d];
    }
    run(r * row, at, row);
  }
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

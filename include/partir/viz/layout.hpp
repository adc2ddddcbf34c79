#pragma once
// A text picture of how a value of rank <= 2 is laid out over the mesh, like
// jax.debug.visualize_array_sharding: one cell per tile (rows: dim 0, columns: dim 1), listing the devices
// that hold it.
//
//   f32[8{batch},4{model}] on {batch=2,model=2}
//   +-----+-----+-----+
//   |     | 0:2 | 2:4 |
//   +-----+-----+-----+
//   | 0:4 | 0   | 1   |
//   | 4:8 | 2   | 3   |
//   +-----+-----+-----+
#include "partir/sharding/partitioned.hpp"

namespace partir {

inline std::string visualize(const TensorType& type, const Sharding& sharding, const Mesh& mesh) {
  validate(sharding, type, mesh);
  if (type.rank() > 2)
    user_error("visualize: " + to_string(type, sharding) + " has rank " + std::to_string(type.rank()) +
               "; only values of rank 0, 1 or 2 can be drawn");
  auto axes = [&](std::size_t d) { return d < sharding.dims.size() ? sharding.dims[d] : AxisList{}; };
  auto size = [&](std::size_t d) { return d < type.shape.size() ? type.shape[d] : std::int64_t{1}; };
  const auto rows = tile_count(axes(0), mesh), cols = tile_count(axes(1), mesh);
  std::vector<std::vector<std::string>> grid(static_cast<std::size_t>(rows) + 1,
                                             std::vector<std::string>(static_cast<std::size_t>(cols) + 1));
  auto range = [&](std::size_t d, std::int64_t tiles, std::int64_t i) {
    const auto step = size(d) / tiles;
    return std::to_string(i * step) + ":" + std::to_string((i + 1) * step);
  };
  if (type.rank() > 0)
    for (std::int64_t r = 0; r < rows; ++r) grid[static_cast<std::size_t>(r) + 1][0] = range(0, rows, r);
  if (type.rank() > 1)
    for (std::int64_t c = 0; c < cols; ++c) grid[0][static_cast<std::size_t>(c) + 1] = range(1, cols, c);
  for (std::int64_t d = 0; d < mesh.num_devices(); ++d) {
    auto& cell = grid[static_cast<std::size_t>(mesh.position(d, axes(0))) + 1]
                     [static_cast<std::size_t>(mesh.position(d, axes(1))) + 1];
    cell += (cell.empty() ? "" : ",") + std::to_string(d);
  }
  std::vector<std::size_t> width(grid[0].size(), 0);
  for (const auto& row : grid)
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  std::string rule = "+";
  for (auto w : width) rule += std::string(w + 2, '-') + "+";
  rule += "\n";
  std::string s = to_string(type, sharding) + " on " + mesh.to_string() + "\n" + rule;
  for (std::size_t r = 0; r < grid.size(); ++r) {
    s += "|";
    for (std::size_t c = 0; c < grid[r].size(); ++c) s += " " + grid[r][c] + std::string(width[c] - grid[r][c].size() + 1, ' ') + "|";
    s += "\n";
    if (r == 0) s += rule;
  }
  s += rule;
  if (!sharding.partial.empty())
    s += "each cell holds partial sums: the value is their sum over " + to_string(sharding.partial) + "\n";
  return s;
}

inline std::string visualize(const Partitioned& p, std::string_view value) {
  const ValueId v = p.value(value);
  return visualize(p.program().type(v), p.sharding(v), p.mesh());
}

}  // namespace partir

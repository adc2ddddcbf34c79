#pragma once
// Sharding: how one value is laid out over a mesh. Each dim is tiled by an ordered list of mesh axes, major
// to minor (dim {batch, model} is cut in |batch| blocks, each cut again in |model|); `partial` lists the axes
// over which the value is a partial sum (PartIR #sum, Shardy "unreduced"): the true value is the sum of the
// pieces held along those axes. An axis used by neither is replicated. An axis appears at most once.
#include <string>
#include <string_view>
#include <vector>

#include "partir/ir/tensor_type.hpp"
#include "partir/mesh.hpp"

namespace partir {

using AxisList = std::vector<std::string>;

struct Sharding {
  std::vector<AxisList> dims;  // one entry per tensor dim
  AxisList partial;            // in mesh order

  static Sharding replicated(std::int64_t rank) { return {std::vector<AxisList>(static_cast<std::size_t>(rank)), {}}; }

  std::int64_t rank() const { return static_cast<std::int64_t>(dims.size()); }
  bool is_replicated() const {
    for (const auto& d : dims)
      if (!d.empty()) return false;
    return partial.empty();
  }
  // The dim tiled on `axis`, -1 if none.
  std::int64_t dim_of(std::string_view axis) const {
    for (std::size_t d = 0; d < dims.size(); ++d)
      for (const auto& a : dims[d])
        if (a == axis) return static_cast<std::int64_t>(d);
    return -1;
  }
  bool is_partial(std::string_view axis) const {
    for (const auto& a : partial)
      if (a == axis) return true;
    return false;
  }
  bool uses(std::string_view axis) const { return dim_of(axis) >= 0 || is_partial(axis); }

  friend bool operator==(const Sharding&, const Sharding&) = default;
};

// Number of tiles a dim tiled on `axes` is cut into.
inline std::int64_t tile_count(const AxisList& axes, const Mesh& mesh) {
  std::int64_t n = 1;
  for (const auto& a : axes) n *= mesh.axis_size(a);
  return n;
}

inline std::string to_string(const AxisList& axes) {
  std::string s = "{";
  for (std::size_t i = 0; i < axes.size(); ++i) s += (i ? "," : "") + axes[i];
  return s + "}";
}

// f32[256{batch},1024{model}] sum{model}: each dim's size with its axes, then the partial-sum axes if any.
inline std::string to_string(const TensorType& type, const Sharding& s) {
  std::string out = std::string(name_of(type.dtype)) + "[";
  for (std::size_t d = 0; d < type.shape.size(); ++d) {
    out += (d ? "," : "") + std::to_string(type.shape[d]);
    if (d < s.dims.size() && !s.dims[d].empty()) out += to_string(s.dims[d]);
  }
  out += "]";
  if (!s.partial.empty()) out += " sum" + to_string(s.partial);
  return out;
}

// Without a type: [{batch},{}] sum{model}.
inline std::string to_string(const Sharding& s) {
  std::string out = "[";
  for (std::size_t d = 0; d < s.dims.size(); ++d) out += (d ? "," : "") + to_string(s.dims[d]);
  out += "]";
  if (!s.partial.empty()) out += " sum" + to_string(s.partial);
  return out;
}

// Checks that `s` can lay out a value of `type` named `value` on `mesh`: matching rank, known axes, each
// axis used once, every dim divisible by its tile count.
inline void validate(const Sharding& s, const TensorType& type, const Mesh& mesh, std::string_view value = "") {
  const std::string who = value.empty() ? "sharding " + to_string(s) + " of " + to_string(type)
                                        : "sharding of '" + std::string(value) + "' " + to_string(type);
  if (s.rank() != type.rank())
    user_error(who + ": " + std::to_string(s.rank()) + " dims given for rank " + std::to_string(type.rank()));
  AxisList seen;
  auto use = [&](const std::string& axis) {
    if (!mesh.has_axis(axis)) user_error(who + ": axis '" + axis + "' is not in mesh " + mesh.to_string());
    for (const auto& a : seen)
      if (a == axis) user_error(who + ": axis '" + axis + "' is used twice");
    seen.push_back(axis);
  };
  for (std::size_t d = 0; d < s.dims.size(); ++d) {
    for (const auto& a : s.dims[d]) use(a);
    const auto tiles = tile_count(s.dims[d], mesh);
    if (type.shape[d] % tiles != 0)
      user_error(who + ": dim " + std::to_string(d) + " (size " + std::to_string(type.shape[d]) +
                 ") is not divisible by " + to_string(s.dims[d]) + " (" + std::to_string(tiles) + " tiles)");
  }
  for (const auto& a : s.partial) use(a);
}

// The shape of the piece each device holds.
inline Shape local_shape(const TensorType& type, const Sharding& s, const Mesh& mesh) {
  validate(s, type, mesh);
  Shape out = type.shape;
  for (std::size_t d = 0; d < out.size(); ++d) out[d] /= tile_count(s.dims[d], mesh);
  return out;
}

}  // namespace partir

#pragma once
// The manual tactics of PartIR.
//   ManualPartition{{{"x", 0}, {"params/*/w1", 1}}, "batch"}   tiles each selected value's dim on an axis
//   Replicate{"params/**", "model"}                           keeps an axis off the selected values for good
// A selector that matches nothing, an axis the mesh lacks, a dim out of range (negative dims count from the
// end) or not divisible by the axis is a UserError naming the tactic.
#include "partir/ir/selector.hpp"
#include "partir/tactics/tactic.hpp"

namespace partir {

struct TileRequest {
  std::string selector;
  std::int64_t dim = 0;
  friend bool operator==(const TileRequest&, const TileRequest&) = default;
};

struct ManualPartition {
  std::vector<TileRequest> tiles;
  std::string axis;
  std::string label = {};  // the name in provenance; "" gives "tile x:0,y:0 on batch"

  std::string name() const {
    if (!label.empty()) return label;
    std::string s = "tile ";
    for (std::size_t i = 0; i < tiles.size(); ++i)
      s += (i ? "," : "") + tiles[i].selector + ":" + std::to_string(tiles[i].dim);
    return s + " on " + axis;
  }

  void apply(PartitionState& s) const;
  friend bool operator==(const ManualPartition&, const ManualPartition&) = default;
};

struct Replicate {
  std::string selector;
  std::string axis;
  std::string label = {};  // "" gives "replicate params/** on model"

  std::string name() const { return label.empty() ? "replicate " + selector + " on " + axis : label; }
  void apply(PartitionState& s) const;
  friend bool operator==(const Replicate&, const Replicate&) = default;
};

#if PARTIR_DEFINE_ENTRIES
namespace detail {
inline std::vector<ValueId> select_for(const PartitionState& s, const NameIndex& names, const std::string& selector) {
  auto values = names.select(selector);
  if (values.empty())
    user_error(s.tactic_label() + ": selector '" + selector + "' matches no input or tagged value of program '" +
               s.program().name() + "'");
  return values;
}
}  // namespace detail

PARTIR_ENTRY void ManualPartition::apply(PartitionState& s) const {
  const int a = s.axis(axis);
  const NameIndex names(s.program());
  for (const auto& t : tiles)
    for (ValueId v : detail::select_for(s, names, t.selector)) {
      const auto rank = s.program().type(v).rank();
      s.tile(v, t.dim < 0 && t.dim >= -rank ? t.dim + rank : t.dim, a);
    }
}

PARTIR_ENTRY void Replicate::apply(PartitionState& s) const {
  const int a = s.axis(axis);
  for (ValueId v : detail::select_for(s, NameIndex(s.program()), selector)) s.forbid(v, a);
}
#endif

}  // namespace partir

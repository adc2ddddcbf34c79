#pragma once
// SpmdProgram: the one program every device runs. Values have per-device (local) types; communication is
// explicit, as collectives over the group of devices that differ along some mesh axes. Each collective
// carries its bytes and the reason it exists (provenance), so a plan can be read, simulated and explained.
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "partir/ir/printer.hpp"
#include "partir/sharding/sharding.hpp"

namespace partir {

enum class CollectiveKind : std::uint8_t { all_gather, all_slice, all_reduce, reduce_scatter, all_to_all };

inline std::string_view name_of(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::all_slice: return "all_slice";
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_to_all: return "all_to_all";
  }
  return "?";
}

// A collective applied to one local value. Tiles along `axes` are ordered major to minor, as in Sharding:
// the device at position p (Mesh::position(device, axes)) holds tile p of the dim.
//   all_gather:     operand dim `dim` grows |axes| times (tiles concatenated in position order)
//   all_slice:      dim `dim` shrinks |axes| times, keeping tile p (local, no communication)
//   all_reduce:     sums the operand over the group (resolves a partial sum)
//   reduce_scatter: all_reduce, then all_slice of `dim`
//   all_to_all:     moves the axes from dim `dim` to dim `to_dim`: locally `to_dim` shrinks |axes| times
//                   (its tile q goes to the member at position q) and `dim` grows |axes| times (the
//                   received tiles concatenated in position order)
struct Collective {
  CollectiveKind kind = CollectiveKind::all_reduce;
  AxisList axes;
  std::int64_t dim = -1;
  std::int64_t to_dim = -1;
  std::string reason;  // why lowering needed it: the op, the operand, the tactic or conflict behind it
  friend bool operator==(const Collective&, const Collective&) = default;
};

// One instruction: a local computation (op.kind, attrs and types are per device) or, when `collective` is
// set, that collective of op.operands[0] with result type op.type (op.kind is then meaningless).
struct SpmdOp {
  Op op;
  std::optional<Collective> collective;
  // gather / scatter_add whose table rows are tiled on these axes: the device holds rows
  // [p * rows, (p + 1) * rows) of the global table; indices outside contribute zero (a partial sum).
  AxisList row_shard;
  friend bool operator==(const SpmdOp&, const SpmdOp&) = default;
};

// A program input or output: its global type and layout, and the local value that holds this device's piece.
struct Binding {
  std::string name;
  ValueId value;
  TensorType global;
  Sharding sharding;
  std::string updates;  // outputs: the input this output replaces next step
  friend bool operator==(const Binding&, const Binding&) = default;
};

struct CollectiveInfo {
  ValueId value;  // the instruction that performs it
  Collective collective;
  TensorType operand;  // local types, per device
  TensorType result;
  std::int64_t bytes;  // per device: the larger of the local operand and result buffers
};

class SpmdProgram {
 public:
  SpmdProgram(std::string name, Mesh mesh) : name_(std::move(name)), mesh_(std::move(mesh)) {}

  const std::string& name() const { return name_; }
  const Mesh& mesh() const { return mesh_; }
  const std::vector<SpmdOp>& ops() const { return ops_; }
  const SpmdOp& op(ValueId v) const { return ops_.at(static_cast<std::size_t>(v)); }
  const TensorType& type(ValueId v) const { return op(v).op.type; }
  std::int64_t size() const { return static_cast<std::int64_t>(ops_.size()); }
  const std::vector<Binding>& inputs() const { return inputs_; }
  const std::vector<Binding>& outputs() const { return outputs_; }

  ValueId add(SpmdOp op) {
    ops_.push_back(std::move(op));
    return static_cast<ValueId>(ops_.size() - 1);
  }
  void add_input(Binding b) { inputs_.push_back(std::move(b)); }
  void add_output(Binding b) { outputs_.push_back(std::move(b)); }

  std::vector<CollectiveInfo> collectives() const {
    std::vector<CollectiveInfo> out;
    for (ValueId v = 0; v < size(); ++v) {
      const auto& s = op(v);
      if (!s.collective) continue;
      const auto& operand = type(s.op.operands.at(0));
      out.push_back({v, *s.collective, operand, s.op.type, std::max(operand.bytes(), s.op.type.bytes())});
    }
    return out;
  }

  // For each instruction, the values whose last use it is (outputs live to the end; unused values die at
  // their own instruction): the executor frees buffers by it.
  std::vector<std::vector<ValueId>> last_uses() const {
    std::vector<ValueId> last(ops_.size(), -1);
    for (ValueId i = 0; i < size(); ++i)
      for (auto v : op(i).op.operands) last[static_cast<std::size_t>(v)] = i;
    for (const auto& o : outputs_) last[static_cast<std::size_t>(o.value)] = static_cast<ValueId>(size());
    std::vector<std::vector<ValueId>> frees(ops_.size());
    for (ValueId v = 0; v < size(); ++v) {
      auto& l = last[static_cast<std::size_t>(v)];
      if (l < 0) l = v;
      if (l < size()) frees[static_cast<std::size_t>(l)].push_back(v);
    }
    return frees;
  }

  friend bool operator==(const SpmdProgram&, const SpmdProgram&) = default;

 private:
  std::string name_;
  Mesh mesh_;
  std::vector<SpmdOp> ops_;
  std::vector<Binding> inputs_, outputs_;
};

inline std::string to_string(const Collective& c) {
  std::string s = std::string(name_of(c.kind)) + to_string(c.axes);
  if (c.dim >= 0) s += " dim " + std::to_string(c.dim);
  if (c.to_dim >= 0) s += " to dim " + std::to_string(c.to_dim);
  return s;
}

// Stable text: one line per instruction with local types; collectives show their group axes, dims,
// bytes and reason.
inline std::ostream& operator<<(std::ostream& os, const SpmdProgram& p) {
  os << "spmd " << p.name() << " on " << p.mesh().to_string() << " {\n";
  for (ValueId v = 0; v < p.size(); ++v) {
    const auto& s = p.op(v);
    if (s.collective) {
      const auto& c = *s.collective;
      os << "  %" << v << " = " << name_of(c.kind) << " %" << s.op.operands.at(0) << " {axes=" << to_string(c.axes);
      if (c.dim >= 0) os << ", dim=" << c.dim;
      if (c.to_dim >= 0) os << ", to_dim=" << c.to_dim;
      os << "} : " << to_string(s.op.type) << "  # " << c.reason << "\n";
      continue;
    }
    std::string line = "%" + std::to_string(v);
    if (!s.op.name.empty()) line += " \"" + s.op.name + "\"";
    line += " = " + std::string(name_of(s.op.kind));
    for (std::size_t i = 0; i < s.op.operands.size(); ++i) line += (i ? ", %" : " %") + std::to_string(s.op.operands[i]);
    line += detail::attrs_str(s.op);
    if (!s.row_shard.empty()) line += " {rows=" + to_string(s.row_shard) + "}";
    os << "  " << line << " : " << to_string(s.op.type) << "\n";
  }
  for (const auto& o : p.outputs()) {
    os << "  output \"" << o.name << "\" = %" << o.value << " : " << to_string(o.global, o.sharding);
    if (!o.updates.empty()) os << " updates \"" << o.updates << "\"";
    os << "\n";
  }
  return os << "}\n";
}

inline std::string to_string(const SpmdProgram& p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

}  // namespace partir

#pragma once
// SpmdProgram: the one program every device runs. Values have per-device (local) types; communication is
// explicit, as collectives over the group of devices that differ along some mesh axes. Each collective
// carries its bytes and the reason it exists (provenance), so a plan can be read, simulated and explained.
#include <atomic>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "partir/ir/printer.hpp"
#include "partir/sharding/sharding.hpp"
#include "partir/sharding/stages.hpp"

namespace partir {

enum class CollectiveKind : std::uint8_t {
  all_gather, all_slice, all_reduce, reduce_scatter, all_to_all, send, recv, collective_permute
};

inline std::string_view name_of(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::all_slice: return "all_slice";
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_to_all: return "all_to_all";
    case CollectiveKind::send: return "send";
    case CollectiveKind::recv: return "recv";
    case CollectiveKind::collective_permute: return "collective_permute";
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
//   send:           point to point, in pipelined programs: the operand goes to stage `peer` of the pipeline
//                   axis `axes` (the device there at this device's position on every other axis); the result
//                   names the moved value and holds nothing
//   recv:           the value that the send operands[0] (same `tag`) moves here from stage `peer`
//   collective_permute: the operand of the member at position p goes to the member at p + `shift` (a halo
//                   exchange between neighbouring tiles); a member with no source gets zeros
struct Collective {
  CollectiveKind kind = CollectiveKind::all_reduce;
  AxisList axes;
  std::int64_t dim = -1;
  std::int64_t to_dim = -1;
  std::string reason;  // why lowering needed it: the op, the operand, the tactic or conflict behind it
  std::int64_t peer = -1;  // send / recv: the other stage
  std::int64_t tag = -1;   // send / recv: matches the two ends
  std::int64_t shift = 0;  // collective_permute
  friend bool operator==(const Collective&, const Collective&) = default;
};

// A stage's unit of work: microbatch j's forward pass through one virtual stage, its backward pass (where the
// schedule splits it, B alone: what the input gradient needs), its weight gradients (W), or the update.
struct StageTask {
  enum class Phase : std::uint8_t { forward, backward, weight, update };
  int chunk = 0;  // the virtual stage
  Phase phase = Phase::forward;
  int microbatch = 0;
  friend auto operator<=>(const StageTask&, const StageTask&) = default;
};

// One instruction: a local computation (op.kind, attrs and types are per device) or, when `collective` is
// set, that collective of op.operands[0] with result type op.type (op.kind is then meaningless).
struct SpmdOp {
  Op op;
  std::optional<Collective> collective;
  // gather / scatter_add whose table rows are tiled on these axes: the device holds rows
  // [p * rows, (p + 1) * rows) of the global table; indices outside contribute zero (a partial sum).
  AxisList row_shard;
  int stage = -1;  // pipelined programs: the stage whose devices run it (-1: every device)
  bool recomputed = false;  // remat's recomputation of a forward value: hardware FLOPs, not the model's
  StageTask task;  // pipelined programs: the task of the schedule it belongs to (spmd/pipeline.hpp)
  // A collective that moves data between devices (all_slice copies this device's own tile).
  bool communicates() const { return collective && collective->kind != CollectiveKind::all_slice; }
  friend bool operator==(const SpmdOp&, const SpmdOp&) = default;
};

namespace detail {
// A value the program is given (a parameter, optimizer state, a batch), not one it computes.
inline bool is_program_input(const SpmdOp& s) { return s.op.kind == OpKind::input && !s.collective; }
}  // namespace detail

// A program cut into pipeline stages (spmd/pipeline.hpp): the devices at position s of `axis` run the ops of
// stage s, in program order, which is the schedule's order on each stage.
struct SpmdPipeline {
  std::string axis;
  int stages = 1;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int microbatches = 1;
  friend bool operator==(const SpmdPipeline&, const SpmdPipeline&) = default;
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
  const std::optional<SpmdPipeline>& pipeline() const { return pipeline_; }
  void set_pipeline(SpmdPipeline p) { pipeline_ = std::move(p); }
  // The stage `device` runs (0 without a pipeline).
  int stage_of(std::int64_t device) const {
    return pipeline_ ? static_cast<int>(mesh_.position(device, {pipeline_->axis})) : 0;
  }
  bool runs(ValueId v, int stage) const { return op(v).stage < 0 || op(v).stage == stage; }

  std::vector<CollectiveInfo> collectives() const {
    std::vector<CollectiveInfo> out;
    for (ValueId v = 0; v < size(); ++v) {
      const auto& s = op(v);
      if (!s.collective) continue;
      const auto& operand = s.op.operands.empty() ? s.op.type : type(s.op.operands[0]);  // a stage's recv
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
  std::optional<SpmdPipeline> pipeline_;
};

// Binds `out`'s inputs and outputs as p's, through `moved` (p's value id -> out's): for passes that rebuild a
// program op by op.
inline void add_bindings(const SpmdProgram& p, SpmdProgram& out, const std::vector<ValueId>& moved) {
  for (Binding b : p.inputs()) {
    b.value = moved[static_cast<std::size_t>(b.value)];
    out.add_input(std::move(b));
  }
  for (Binding b : p.outputs()) {
    b.value = moved[static_cast<std::size_t>(b.value)];
    out.add_output(std::move(b));
  }
}

// The program's instructions in a new order, or some of them (every operand kept, and before its user).
inline SpmdProgram reordered(const SpmdProgram& p, const std::vector<ValueId>& order) {
  std::vector<ValueId> moved(static_cast<std::size_t>(p.size()), -1);
  SpmdProgram out(p.name(), p.mesh());
  if (p.pipeline()) out.set_pipeline(*p.pipeline());
  for (auto v : order) {
    SpmdOp s = p.op(v);
    for (auto& o : s.op.operands) o = moved[static_cast<std::size_t>(o)];
    moved[static_cast<std::size_t>(v)] = out.add(std::move(s));
  }
  add_bindings(p, out, moved);
  return out;
}

// p without the local ops whose values nothing uses: lowering leaves some behind (a whole broadcast that a
// tile's use made again at the tile's shape), and the executor would compute them. Collectives stay: every
// device runs each one.
inline SpmdProgram without_dead_ops(const SpmdProgram& p) {
  std::vector<bool> live(static_cast<std::size_t>(p.size()), false);
  for (const auto& b : p.outputs()) live[static_cast<std::size_t>(b.value)] = true;
  for (ValueId v = p.size() - 1; v >= 0; --v) {
    const SpmdOp& s = p.op(v);
    if (s.collective || detail::is_program_input(s)) live[static_cast<std::size_t>(v)] = true;
    if (live[static_cast<std::size_t>(v)])
      for (auto o : s.op.operands) live[static_cast<std::size_t>(o)] = true;
  }
  std::vector<ValueId> kept;
  for (ValueId v = 0; v < p.size(); ++v)
    if (live[static_cast<std::size_t>(v)]) kept.push_back(v);
  return kept.size() == live.size() ? p : reordered(p, kept);
}

// What the devices of one stage run: the ops of `stage` (and the inputs every stage holds) in program order,
// renumbered; a recv keeps no operand (its send runs elsewhere) and a send's result holds nothing. Outputs
// are those this stage holds, a received copy standing for a value made on another stage. `ids`, if given,
// receives the pipelined program's id of each op. A program without a pipeline is its own stage 0.
namespace detail {
// How many stage programs this process has cut: an ExecutionPlan cuts each stage once, never per step.
inline std::atomic<std::int64_t>& stage_programs_cut() {
  static std::atomic<std::int64_t> count{0};
  return count;
}
}  // namespace detail

inline SpmdProgram stage_program(const SpmdProgram& p, int stage, std::vector<ValueId>* ids = nullptr) {
  ++detail::stage_programs_cut();
  SpmdProgram out(p.name(), p.mesh());
  std::vector<ValueId> local(static_cast<std::size_t>(p.size()), -1);
  std::map<ValueId, ValueId> received;  // value sent from another stage -> its recv here
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!p.runs(v, stage)) continue;
    SpmdOp s = p.op(v);
    if (s.collective && s.collective->kind == CollectiveKind::recv) {
      received[p.op(s.op.operands.at(0)).op.operands.at(0)] = static_cast<ValueId>(out.size());
      s.op.operands.clear();
    }
    for (auto& o : s.op.operands) o = local[static_cast<std::size_t>(o)];
    if (s.collective && s.collective->kind == CollectiveKind::send) s.op.type.shape = {0};
    local[static_cast<std::size_t>(v)] = out.add(std::move(s));
    if (ids) ids->push_back(v);
  }
  for (Binding b : p.inputs())
    if (p.runs(b.value, stage)) {
      b.value = local[static_cast<std::size_t>(b.value)];
      out.add_input(std::move(b));
    }
  for (Binding b : p.outputs()) {
    if (p.runs(b.value, stage)) b.value = local[static_cast<std::size_t>(b.value)];
    else if (auto it = received.find(b.value); it != received.end()) b.value = it->second;
    else continue;
    out.add_output(std::move(b));
  }
  return out;
}

inline std::string to_string(const Collective& c) {
  std::string s = std::string(name_of(c.kind)) + to_string(c.axes);
  if (c.dim >= 0) s += " dim " + std::to_string(c.dim);
  if (c.to_dim >= 0) s += " to dim " + std::to_string(c.to_dim);
  if (c.peer >= 0) s += (c.kind == CollectiveKind::send ? " to stage " : " from stage ") + std::to_string(c.peer);
  if (c.shift) s += " shift " + std::to_string(c.shift);
  return s;
}

// Stable text: one line per instruction with local types; collectives show their group axes, dims,
// bytes and reason.
inline std::ostream& operator<<(std::ostream& os, const SpmdProgram& p) {
  os << "spmd " << p.name() << " on " << p.mesh().to_string();
  if (const auto& pp = p.pipeline())
    os << " pipelined over " << pp->axis << " (" << pp->stages << " stages, " << name_of(pp->schedule) << ", "
       << pp->microbatches << " microbatches)";
  os << " {\n";
  for (ValueId v = 0; v < p.size(); ++v) {
    const auto& s = p.op(v);
    if (s.collective) {
      const auto& c = *s.collective;
      os << "  %" << v << " = " << name_of(c.kind) << " %" << s.op.operands.at(0) << " {axes=" << to_string(c.axes);
      if (c.dim >= 0) os << ", dim=" << c.dim;
      if (c.to_dim >= 0) os << ", to_dim=" << c.to_dim;
      if (c.peer >= 0) os << ", peer=" << c.peer << ", tag=" << c.tag;
      if (c.shift) os << ", shift=" << c.shift;
      os << "}" << (s.stage >= 0 ? " @" + std::to_string(s.stage) : "") << " : " << to_string(s.op.type) << "  # " << c.reason << "\n";
      continue;
    }
    std::string line = "%" + std::to_string(v);
    if (!s.op.name.empty()) line += " \"" + s.op.name + "\"";
    line += " = " + std::string(name_of(s.op.kind));
    for (std::size_t i = 0; i < s.op.operands.size(); ++i) line += (i ? ", %" : " %") + std::to_string(s.op.operands[i]);
    line += detail::attrs_str(s.op);
    if (!s.row_shard.empty()) line += " {rows=" + to_string(s.row_shard) + "}";
    if (s.stage >= 0) line += " @" + std::to_string(s.stage);
    os << "  " << line << " : " << to_string(s.op.type) << "\n";
  }
  for (const auto& o : p.outputs()) {
    os << "  output \"" << o.name << "\" = %" << o.value << " : " << to_string(o.global, o.sharding);
    if (!o.updates.empty()) os << " updates \"" << o.updates << "\"";
    os << "\n";
  }
  return os << "}\n";
}

// Per value: a program input that some output replaces next step (Binding::updates), the state a training step
// may consume (ExecuteOptions::donate, SimulateOptions::donate_state).
inline std::vector<bool> updated_inputs(const SpmdProgram& p) {
  std::vector<bool> updated(static_cast<std::size_t>(p.size()), false);
  for (const auto& o : p.outputs())
    for (const auto& b : p.inputs())
      if (!o.updates.empty() && b.name == o.updates) updated[static_cast<std::size_t>(b.value)] = true;
  return updated;
}

inline std::string to_string(const SpmdProgram& p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

}  // namespace partir

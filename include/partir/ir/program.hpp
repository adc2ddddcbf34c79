#pragma once
// Program: an SSA tensor program. Ops are stored in definition order (a topological order); each op's
// result is the value with the op's index. Inputs are ops of kind `input` with a unique name; outputs are
// named references to values. An output may update an input ("loop-carried state": new params replace the
// params of the next step), which sharding uses to give both the same layout.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "partir/ir/shape_inference.hpp"

namespace partir {

struct Output {
  std::string name;
  ValueId value;
  std::string updates;  // name of the input this output replaces in the next step, "" if none
  friend bool operator==(const Output&, const Output&) = default;
};

// A value the backward pass computes again instead of keeping it from the forward pass (autodiff/remat.hpp).
struct Recompute {
  ValueId value, original;
  std::string policy;  // the Remat that made it, for provenance
  friend bool operator==(const Recompute&, const Recompute&) = default;
};

// Where a run of ops begins in a training step: microbatch m's forward pass, its backward pass, or the update
// after every microbatch (train_step marks them). A run lasts until the next one begins. Pipeline schedules
// order these passes per stage (tactics/pipeline.hpp); a program without segments is one forward pass.
struct Segment {
  enum class Pass : std::uint8_t { forward, backward, update };
  ValueId begin = 0;
  int microbatch = 0;
  Pass pass = Pass::forward;
  friend bool operator==(const Segment&, const Segment&) = default;
};

// A function traced as several ops whose backward pass is one rule of its own (autodiff/grad.hpp), as JAX's
// custom_vjp: softmax's gradient needs only its result, where the VJPs of its ops would keep the widened input
// and the exponentials alive from the forward pass to the backward. The ops [first, root] are the function's,
// root (the key in Program::composites) its result; `input` its argument; `saved` an inner value the rule
// reads (normalize: 1 / sigma; rms_normalize: 1 / rms), -1 if none; `axis` the one it works along.
struct Composite {
  enum class Kind : std::uint8_t { softmax, log_softmax, normalize, rms_normalize };
  Kind kind = Kind::softmax;
  ValueId first = 0, input = -1, saved = -1;
  std::int64_t axis = -1;
  friend bool operator==(const Composite&, const Composite&) = default;
};

class Program {
 public:
  explicit Program(std::string name = "main") : name_(std::move(name)) {}

  const std::string& name() const { return name_; }
  const std::vector<Op>& ops() const { return ops_; }
  const Op& op(ValueId v) const { return ops_.at(static_cast<std::size_t>(v)); }
  const TensorType& type(ValueId v) const { return op(v).type; }
  std::int64_t size() const { return static_cast<std::int64_t>(ops_.size()); }
  const std::vector<Output>& outputs() const { return outputs_; }
  const std::vector<ValueId>& inputs() const { return inputs_; }

  // Appends an op after inferring (and so checking) its result type.
  ValueId add(OpKind kind, std::vector<ValueId> operands, Attrs attrs = {}, std::string name = "") {
    std::vector<TensorType> types;
    for (auto v : operands) {
      if (v < 0 || v >= size())
        user_error(std::string(name_of(kind)) + ": operand %" + std::to_string(v) + " is not defined in program '" +
                   name_ + "'");
      types.push_back(type(v));
    }
    if (kind == OpKind::input) {
      if (name.empty()) user_error("input: every input needs a name");
      if (find_input(name)) user_error("input '" + name + "' is declared twice in program '" + name_ + "'");
    }
    TensorType t = infer_type(kind, types, attrs);
    ops_.push_back(Op{kind, std::move(operands), std::move(attrs), std::move(t), std::move(name)});
    ValueId id = static_cast<ValueId>(ops_.size() - 1);
    if (kind == OpKind::input) inputs_.push_back(id);
    return id;
  }

  // Appends an op whose type the caller vouches for (transforms that copy checked ops, verifier tests).
  ValueId add_unchecked(Op op) {
    ops_.push_back(std::move(op));
    ValueId id = static_cast<ValueId>(ops_.size() - 1);
    if (ops_.back().kind == OpKind::input) inputs_.push_back(id);
    return id;
  }

  ValueId add_input(const std::string& name, TensorType type, InputKind kind = InputKind::data, Init init = {}) {
    Attrs a;
    a.shape = type.shape;
    a.dtype = type.dtype;
    a.input_kind = kind;
    a.init = init;
    return add(OpKind::input, {}, std::move(a), name);
  }

  void add_output(const std::string& name, ValueId value, const std::string& updates = "") {
    if (value < 0 || value >= size()) user_error("output '" + name + "': value %" + std::to_string(value) + " is not defined");
    for (const auto& o : outputs_)
      if (o.name == name) user_error("output '" + name + "' is declared twice in program '" + name_ + "'");
    if (!updates.empty()) {
      auto in = find_input(updates);
      if (!in) user_error("output '" + name + "' updates unknown input '" + updates + "'");
      if (type(*in) != type(value))
        user_error("output '" + name + "' " + to_string(type(value)) + " cannot update input '" + updates + "' " +
                   to_string(type(*in)));
    }
    outputs_.push_back({name, value, updates});
  }

  // Names an intermediate so tactics can select it (PartIR's tagged values).
  void tag(ValueId v, const std::string& name) {
    auto& o = ops_.at(static_cast<std::size_t>(v));
    if (o.kind == OpKind::input) user_error("tag '" + name + "': input '" + o.name + "' already has a name");
    o.name = name;
  }

  // Names a value for rematerialization policies (autodiff/remat.hpp), apart from tags: a checkpoint name never
  // changes what a tactic selects (JAX's checkpoint_name).
  void checkpoint_name(ValueId v, const std::string& name) {
    if (v < 0 || v >= size()) user_error("checkpoint_name '" + name + "': %" + std::to_string(v) + " is not defined");
    checkpoint_names_[v] = name;
  }
  const std::map<ValueId, std::string>& checkpoint_names() const { return checkpoint_names_; }
  void add_recompute(Recompute r) { recomputes_.push_back(std::move(r)); }
  void mark_composite(ValueId root, Composite c) { composites_[root] = c; }
  const std::map<ValueId, Composite>& composites() const { return composites_; }
  const std::vector<Recompute>& recomputes() const { return recomputes_; }

  std::optional<ValueId> find_input(const std::string& name) const {
    for (auto v : inputs_)
      if (ops_[v].name == name) return v;
    return std::nullopt;
  }
  ValueId input(const std::string& name) const {
    if (auto v = find_input(name)) return *v;
    user_error("program '" + name_ + "' has no input named '" + name + "'");
  }
  std::optional<ValueId> find_output(const std::string& name) const {
    for (const auto& o : outputs_)
      if (o.name == name) return o.value;
    return std::nullopt;
  }
  ValueId output(const std::string& name) const {
    if (auto v = find_output(name)) return *v;
    user_error("program '" + name_ + "' has no output named '" + name + "'");
  }
  // A value's display name: its input name or tag, else %id.
  std::string label(ValueId v) const {
    const auto& n = op(v).name;
    return n.empty() ? "%" + std::to_string(v) : n;
  }

  // Where the backward pass begins (set by grad): ops from here on run after the loss. Lowering gathers a
  // sharded parameter again for them instead of keeping the forward pass's copy alive (ZeRO-3's schedule).
  void mark_backward_start(ValueId first) {
    if (!backward_start_) backward_start_ = first;
  }
  std::optional<ValueId> backward_start() const { return backward_start_; }

  // The ops [first, end) are the vector-Jacobian product of forward value `of` (set by grad): a pipeline
  // stage runs the backward of what it ran forward.
  void mark_vjp(ValueId first, ValueId end, ValueId of) {
    if (end > first && vjp_of_.size() < static_cast<std::size_t>(end)) vjp_of_.resize(static_cast<std::size_t>(end), -1);
    for (ValueId v = first; v < end; ++v) vjp_of_[static_cast<std::size_t>(v)] = of;
  }
  ValueId vjp_of(ValueId v) const { return static_cast<std::size_t>(v) < vjp_of_.size() ? vjp_of_[static_cast<std::size_t>(v)] : -1; }
  void begin_segment(Segment s) { segments_.push_back(s); }
  const std::vector<Segment>& segments() const { return segments_; }

  friend bool operator==(const Program&, const Program&) = default;

 private:
  std::string name_;
  std::optional<ValueId> backward_start_;
  std::vector<ValueId> vjp_of_;     // per op, -1 if it is no VJP's
  std::vector<Segment> segments_;   // ascending begin
  std::vector<Op> ops_;
  std::vector<ValueId> inputs_;
  std::vector<Output> outputs_;
  std::map<ValueId, std::string> checkpoint_names_;
  std::vector<Recompute> recomputes_;
  std::map<ValueId, Composite> composites_;  // by root
};

// Number of uses of each value (operands and outputs), the basis of liveness.
inline std::vector<int> use_counts(const Program& p) {
  std::vector<int> uses(static_cast<std::size_t>(p.size()), 0);
  for (const auto& op : p.ops())
    for (auto v : op.operands) ++uses[v];
  for (const auto& o : p.outputs()) ++uses[o.value];
  return uses;
}

// For each op index, the values whose last use is that op (outputs are never freed; an unused value is
// freed at its own op).
inline std::vector<std::vector<ValueId>> last_uses(const Program& p) {
  std::vector<ValueId> last(static_cast<std::size_t>(p.size()), -1);
  for (ValueId i = 0; i < p.size(); ++i)
    for (auto v : p.op(i).operands) last[v] = i;
  for (const auto& o : p.outputs()) last[o.value] = static_cast<ValueId>(p.size());
  std::vector<std::vector<ValueId>> frees(static_cast<std::size_t>(p.size()));
  for (ValueId v = 0; v < p.size(); ++v) {
    if (last[v] < 0) last[v] = v;  // never used: dead right after it is made
    if (last[v] < p.size()) frees[last[v]].push_back(v);
  }
  return frees;
}

}  // namespace partir

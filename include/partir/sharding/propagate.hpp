#pragma once
// PartitionState: the shardings of a program's values while tactics run, and the propagation that extends
// each tactic's decisions through the tile-mapping registry.
//
// Tactics seed decisions (tile(), forbid()); propagate() then carries every new axis forward and backward
// through the ops' rules to a fixed point, with a worklist of ops per axis (linear in the ops an axis
// reaches). Axes are propagated one at a time, in the order they were seeded, so an earlier decision has
// always travelled as far as it can before a later one moves.
//
// Rules of the road, for one op and one axis a:
// - a tiles one factor of the op: every tensor holding that factor gets a on the matching dim (a reduction
//   factor instead makes the result a partial sum over a). The op is all or nothing: if any tensor cannot
//   take a, none does.
// - Conflicts (recorded with both origins, nothing changed, no tie-breaking): a on two different factors
//   of the op; a tensor that already has a on another dim or that a Replicate tactic keeps off a; a tensor
//   whose dim already has other axes than those that precede a at the source (layouts would disagree on
//   the order of the axes).
// - Stops (recorded with the reason, nothing changed): a need-replication factor; a factor too small to be
//   cut |a| ways; a merged reshape dim whose major factor is not tiled yet (a would need a sub-axis); a
//   tensor that is a partial sum over a (lowering reduces it there: with a tiled result, a reduce_scatter,
//   which is how tiling optimizer state on the batch axis turns gradient all_reduces into reduce_scatters).
// - Partial sums flow forward only, through ops linear in the partial operands (OpRule::partial): add of
//   two partial sums, mul of a partial sum by a value not using a, a transpose of one... Elsewhere, and
//   where a Replicate keeps a off the result, the result is not partial: lowering all-reduces the operand.
// - Loop-carried state: an output that updates an input is tied to it as by an identity op (same factors
//   dim for dim), so step N+1 reads what step N wrote with the same layout. Ties carry tiles, not partial
//   sums: an input is never a partial sum. A value the backward pass recomputes (remat.hpp) is tied to its
//   original the same way.
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include "partir/sharding/provenance.hpp"
#include "partir/sharding/rules.hpp"
#include "partir/sharding/sharding.hpp"
#include "partir/sharding/stages.hpp"

namespace partir {

class PartitionState {
 public:
  PartitionState(const Program& program, const Mesh& mesh) : graph_(std::make_shared<const Graph>(program, mesh)) {
    values_.resize(static_cast<std::size_t>(program.size()));
    for (ValueId v = 0; v < program.size(); ++v)
      values_[static_cast<std::size_t>(v)].dims.resize(static_cast<std::size_t>(program.type(v).rank()));
  }

  const Program& program() const { return graph_->program; }
  const Mesh& mesh() const { return graph_->mesh; }

  // --- tactic bookkeeping (partition() drives it) ---
  void begin_tactic(std::string name) { tactics_.push_back(std::move(name)); }
  const std::vector<std::string>& tactics() const { return tactics_; }
  // "tactic 2 (megatron)": the current tactic, numbered from 1 as users count them.
  std::string tactic_label(int tactic = -1) const {
    if (tactic < 0) tactic = current();
    if (tactic < 0) return "no tactic";
    return "tactic " + std::to_string(tactic + 1) + " (" + tactics_[static_cast<std::size_t>(tactic)] + ")";
  }

  // The mesh axis named `name`, or a UserError naming the current tactic.
  int axis(std::string_view name) const {
    const int a = mesh().find_axis(name);
    if (a < 0) user_error(tactic_label() + ": axis '" + std::string(name) + "' is not in mesh " + mesh().to_string());
    return a;
  }

  // --- decisions of the current tactic ---

  // Tiles `dim` of v on mesh axis `axis` (appended as the dim's most minor axis). A request the schedule
  // cannot mean (dim out of range, size not divisible, two dims of one value in one tactic) is a UserError;
  // one that an earlier tactic's decision overrules is a recorded Conflict.
  void tile(ValueId v, std::int64_t dim, int axis) {
    const TensorType& type = program().type(v);
    if (dim < 0 || dim >= type.rank())
      user_error(tactic_label() + ": dim " + std::to_string(dim) + " is out of range for " + program().label(v) +
                 " " + to_string(type));
    auto& s = value(v);
    const Origin wanted{current(), v, dim};
    if (const auto* p = find(v, axis)) {
      if (p->dim == dim) return;  // already so: applying a tactic twice changes nothing
      if (p->tactic == current() && p->via == Provenance::Via::seed && p->dim >= 0)
        user_error(tactic_label() + ": conflicting requests for " + program().label(v) + " on '" + axis_name(axis) +
                   "': dim " + std::to_string(p->dim) + " and dim " + std::to_string(dim));
      return conflict(axis, -1, wanted, origin(v, axis));
    }
    AxisList axes = names(s.dims[static_cast<std::size_t>(dim)]);
    axes.push_back(axis_name(axis));
    const auto tiles = tile_count(axes, mesh());
    const auto size = type.shape[static_cast<std::size_t>(dim)];
    if (size % tiles != 0)
      user_error(tactic_label() + ": " + program().label(v) + " dim " + std::to_string(dim) + " (size " +
                 std::to_string(size) + ") is not divisible by " + to_string(axes) + " (" + std::to_string(tiles) +
                 " tiles)");
    place(v, axis, dim, {axis, dim, current(), Provenance::Via::seed, -1, -1, partial_dim});
    pending_.emplace_back(axis, v);
  }

  // Keeps `axis` off v for good (PartIR's atomic): propagation may neither tile v on it nor make v a partial
  // sum over it.
  void forbid(ValueId v, int axis) {
    if (const auto* p = find(v, axis)) {
      if (p->dim != replicated_dim) conflict(axis, -1, {current(), v, replicated_dim}, origin(v, axis));
      return;
    }
    place(v, axis, replicated_dim, {axis, replicated_dim, current(), Provenance::Via::seed, -1, -1, partial_dim});
  }

  // Carries every decision made since the last call to a fixed point.
  void propagate() {
    std::vector<int> axes;
    for (const auto& [a, v] : pending_)
      if (std::find(axes.begin(), axes.end(), a) == axes.end()) axes.push_back(a);
    for (int a : axes) {
      queued_.assign(graph_->nodes.size(), 0);
      for (const auto& [b, v] : pending_)
        if (b == a) enqueue_users(v);
      while (!queue_.empty()) {
        const int n = queue_.front();
        queue_.pop_front();
        queued_[static_cast<std::size_t>(n)] = 0;
        evaluate(n, a);
      }
    }
    pending_.clear();
  }

  // --- results ---
  Sharding sharding(ValueId v) const {
    const auto& s = value(v);
    Sharding out;
    for (const auto& d : s.dims) out.dims.push_back(names(d));
    for (int a = 0; a < static_cast<int>(mesh().rank()); ++a)
      if (s.partial & bit(a)) out.partial.push_back(axis_name(a));
    return out;
  }
  // Set by a pipeline tactic: the stage of every value (lowering cuts the program there).
  void set_pipeline(PipelineStages p) { pipeline_ = std::move(p); }
  const std::optional<PipelineStages>& pipeline() const { return pipeline_; }

  std::vector<Sharding> shardings() const {
    std::vector<Sharding> out;
    for (ValueId v = 0; v < program().size(); ++v) out.push_back(sharding(v));
    return out;
  }
  const std::vector<Conflict>& conflicts() const { return conflicts_; }
  const std::vector<Stop>& stops() const { return stops_; }
  // One record per axis on v (tiled, partial, or kept off by Replicate), in the order they were placed.
  const std::vector<Provenance>& provenance(ValueId v) const { return value(v).origins; }
  // Where an op's rule came from for provenance rendering: "%3 dot_general" or the tie's description.
  std::string site(Provenance::Via via, std::int32_t site) const {
    if (via == Provenance::Via::tie) {
      const auto& o = program().outputs()[static_cast<std::size_t>(site)];
      return "output '" + o.name + "' updates input '" + o.updates + "'";
    }
    if (via == Provenance::Via::remat) {
      const auto& r = program().recomputes()[static_cast<std::size_t>(site)];
      return "%" + std::to_string(r.value) + " recomputes %" + std::to_string(r.original) + " (remat " + r.policy + ")";
    }
    return "%" + std::to_string(site) + " " + std::string(name_of(program().op(site).kind));
  }

 private:
  // An op, or the tie of a loop-carried output to its input, seen as tensors ("slots") sharing factors.
  struct Node {
    std::vector<ValueId> slots;  // operands, then the result for an op; output value and input for a tie
    bool has_result = false;
    Provenance::Via via = Provenance::Via::op;
    std::int32_t site = -1;      // op id, or output index for a tie
    OpRule rule;
    const std::vector<DimFactors>& dims(std::size_t slot) const {
      return slot < rule.operands.size() ? rule.operands[slot] : rule.result;
    }
  };

  struct Graph {
    Program program;
    Mesh mesh;
    std::vector<Node> nodes;               // node i < program.size() is op i
    std::vector<std::vector<int>> users;   // value -> nodes holding it (leaf ops excluded: nothing to carry)

    // Two tensors of one type sharing every factor, dim for dim.
    static OpRule identity(const TensorType& t) {
      std::vector<DimFactors> dims;
      OpRule r;
      for (auto s : t.shape) {
        dims.push_back({static_cast<int>(r.factors.size())});
        r.factors.push_back({s, FactorKind::pass_through, {}});
      }
      r.operands = {dims, dims};
      return r;
    }

    Graph(const Program& p, const Mesh& m) : program(p), mesh(m), users(static_cast<std::size_t>(p.size())) {
      for (ValueId v = 0; v < p.size(); ++v) {
        Node n{p.op(v).operands, true, Provenance::Via::op, v, rule_for(p, v)};
        n.slots.push_back(v);
        nodes.push_back(std::move(n));
      }
      std::map<std::string_view, ValueId> inputs;
      for (auto v : p.inputs()) inputs.emplace(p.op(v).name, v);
      for (std::size_t i = 0; i < p.outputs().size(); ++i) {
        const auto& o = p.outputs()[i];
        if (o.updates.empty()) continue;
        const ValueId in = inputs.at(o.updates);
        nodes.push_back({{o.value, in}, false, Provenance::Via::tie, static_cast<std::int32_t>(i), identity(p.type(in))});
      }
      // A recomputed value is tied to its original alike: the backward pass computes it on the same tiles.
      for (std::size_t i = 0; i < p.recomputes().size(); ++i) {
        const auto& r = p.recomputes()[i];
        nodes.push_back({{r.value, r.original}, false, Provenance::Via::remat, static_cast<std::int32_t>(i),
                         identity(p.type(r.original))});
      }
      for (std::size_t n = 0; n < nodes.size(); ++n) {
        if (nodes[n].slots.size() < 2) continue;
        for (auto v : nodes[n].slots) {
          auto& u = users[static_cast<std::size_t>(v)];
          if (u.empty() || u.back() != static_cast<int>(n)) u.push_back(static_cast<int>(n));
        }
      }
      std::vector<ValueId> op_users;  // the ops reading v, once each
      for (ValueId v = 0; v < p.size(); ++v) {
        if (p.op(v).kind != OpKind::convert) continue;
        op_users.clear();
        for (int n : users[static_cast<std::size_t>(v)])
          if (n != v && n < p.size()) op_users.push_back(n);
        nodes[static_cast<std::size_t>(v)].rule = rule_for(p, v, op_users);
      }
    }
  };

  struct ValueState {
    std::vector<std::vector<int>> dims;  // mesh axes tiling each dim, major to minor
    std::uint32_t used = 0;              // axes tiling a dim or partial or forbidden (bit per axis)
    std::uint32_t partial = 0;
    std::vector<Provenance> origins;
  };

  // Why an axis cannot go onto a value at an op: a conflict with an earlier decision, or a stop.
  struct Block {
    std::optional<Origin> existing;  // set: a conflict
    std::string reason;              // a stop's reason, or what a conflict is about when it is not plain
  };

  static std::uint32_t bit(int axis) { return std::uint32_t{1} << axis; }
  int current() const { return static_cast<int>(tactics_.size()) - 1; }
  const std::string& axis_name(int a) const { return mesh().axes()[static_cast<std::size_t>(a)].name; }
  std::int64_t axis_size(int a) const { return mesh().axes()[static_cast<std::size_t>(a)].size; }
  AxisList names(const std::vector<int>& axes) const {
    AxisList out;
    for (int a : axes) out.push_back(axis_name(a));
    return out;
  }
  ValueState& value(ValueId v) { return values_[static_cast<std::size_t>(v)]; }
  const ValueState& value(ValueId v) const { return values_[static_cast<std::size_t>(v)]; }

  const Provenance* find(ValueId v, int axis) const {
    if (!(value(v).used & bit(axis))) return nullptr;
    for (const auto& p : value(v).origins)
      if (p.axis == axis) return &p;
    internal_error("no provenance for an axis in use");
  }
  Origin origin(ValueId v, int axis) const {
    const auto* p = find(v, axis);
    return p ? Origin{p->tactic, v, p->dim} : Origin{-1, v, partial_dim};
  }

  void place(ValueId v, int axis, std::int64_t dim, const Provenance& p) {
    auto& s = value(v);
    s.used |= bit(axis);
    if (dim >= 0) s.dims[static_cast<std::size_t>(dim)].push_back(axis);
    if (dim == partial_dim) s.partial |= bit(axis);
    s.origins.push_back(p);
  }

  void enqueue_users(ValueId v) {
    for (int n : graph_->users[static_cast<std::size_t>(v)]) {
      if (queued_[static_cast<std::size_t>(n)]) continue;
      queued_[static_cast<std::size_t>(n)] = 1;
      queue_.push_back(n);
    }
  }

  std::string node_site(int node, ValueId seed) const {
    if (node < 0) return program().label(seed);
    const Node& n = graph_->nodes[static_cast<std::size_t>(node)];
    return site(n.via, n.site);
  }

  // "x dim 0 by tactic 1 (bp)"
  std::string describe(const Origin& o) const {
    std::string s = program().label(o.value);
    s += o.dim >= 0 ? " dim " + std::to_string(o.dim) : o.dim == partial_dim ? " as a partial sum" : " kept replicated";
    return s + " by " + tactic_label(o.tactic);
  }

  // At `node`, or at a seed (node -1).
  void conflict(int axis, int node, const Origin& wanted, const Origin& existing, const std::string& about = "") {
    if (!reported_.emplace(node, axis, wanted.value, wanted.dim, existing.value, existing.dim).second) return;
    Conflict c{current(), axis_name(axis), node_site(node, wanted.value), wanted, existing, ""};
    c.message = tactic_label() + ": '" + c.axis + "' at " + c.site + ": " + describe(wanted) + " conflicts with " +
                describe(existing) + (about.empty() ? "" : " (" + about + ")");
    conflicts_.push_back(std::move(c));
  }

  void stop(int axis, int node, const Origin& from, const std::string& reason) {
    if (!reported_.emplace(node, axis, -1, 0, -1, 0).second) return;
    Stop s{current(), axis_name(axis), node_site(node, from.value), from, reason, ""};
    s.message = tactic_label() + ": '" + s.axis + "' stops at " + s.site + " (from " + describe(from) + "): " + reason;
    stops_.push_back(std::move(s));
  }

  std::optional<FactorSplit> split(const std::vector<int>& axes, const DimFactors& factors, const OpRule& r) const {
    std::vector<std::int64_t> sizes;
    for (int a : axes) sizes.push_back(axis_size(a));
    return split_axes(sizes, factors, r);
  }

  // Can `axis` go on dim e of the value in slot s, cutting factor f after exactly the axes `before`?
  std::optional<Block> check(const Node& n, std::size_t s, std::int64_t e, int f, const std::vector<int>& before,
                             int axis) const {
    const ValueId v = n.slots[s];
    const auto& st = value(v);
    if (const auto* p = find(v, axis)) {
      if (p->dim == partial_dim) return Block{std::nullopt, partial_reason(v, axis)};
      return Block{origin(v, axis), ""};
    }
    const auto& axes = st.dims[static_cast<std::size_t>(e)];
    const auto& factors = n.dims(s)[static_cast<std::size_t>(e)];
    const auto on = split(axes, factors, n.rule);
    if (!on) return Block{std::nullopt, program().label(v) + " dim " + std::to_string(e) + " is tiled across factors"};
    const auto j = static_cast<std::size_t>(std::find(factors.begin(), factors.end(), f) - factors.begin());
    for (std::size_t k = 0; k < j; ++k)
      if (on->left[k] != 1)
        return Block{std::nullopt, program().label(v) + " dim " + std::to_string(e) +
                                       " is a merged dim whose major part is not tiled (that needs a sub-axis)"};
    std::vector<int> mine;  // the axes v already has on f or on later factors
    for (std::size_t i = 0; i < axes.size(); ++i)
      if (std::find(factors.begin() + static_cast<std::ptrdiff_t>(j), factors.end(), on->factor_of_axis[i]) !=
          factors.end())
        mine.push_back(axes[i]);
    for (std::size_t i = 0; i < mine.size(); ++i)
      if (i >= before.size() || mine[i] != before[i])
        return Block{origin(v, mine[i]), "axis order: '" + axis_name(axis) + "' would follow " + to_string(names(mine)) +
                                             " here but " + to_string(names(before)) + " at the source"};
    if (mine.size() < before.size())
      return Block{std::nullopt, program().label(v) + " dim " + std::to_string(e) + " lacks '" +
                                     axis_name(before[mine.size()]) + "', which comes before '" + axis_name(axis) +
                                     "' at the source"};
    if (on->left[j] % axis_size(axis) != 0)
      return Block{std::nullopt, "factor of size " + std::to_string(n.rule.factors[static_cast<std::size_t>(f)].size) +
                                     " of " + program().label(v) + " dim " + std::to_string(e) + " cannot be cut " +
                                     std::to_string(axis_size(axis)) + " ways"};
    return std::nullopt;
  }

  std::string partial_reason(ValueId v, int axis) const {
    return program().label(v) + " is a partial sum over '" + axis_name(axis) + "' from " +
           tactic_label(origin(v, axis).tactic) + ": lowering reduces it first";
  }

  void evaluate(int node, int axis) {
    const Node& n = graph_->nodes[static_cast<std::size_t>(node)];
    const std::size_t result = n.has_result ? n.slots.size() - 1 : n.slots.size();
    // 1. The factor `axis` tiles at this op, and its source: the first tensor holding it.
    int factor = -1;
    std::size_t source = 0;
    std::vector<int> before;
    for (std::size_t s = 0; s < n.slots.size(); ++s) {
      const ValueId v = n.slots[s];
      const auto* p = find(v, axis);
      if (!p || p->dim < 0) continue;
      const auto& axes = value(v).dims[static_cast<std::size_t>(p->dim)];
      const auto on = split(axes, n.dims(s)[static_cast<std::size_t>(p->dim)], n.rule);
      if (!on)
        return stop(axis, node, origin(v, axis),
                    program().label(v) + " dim " + std::to_string(p->dim) + " " + to_string(names(axes)) +
                        " does not line up with the factors of " + to_string(n.rule) + " (that needs a sub-axis)");
      const auto pos = static_cast<std::size_t>(std::find(axes.begin(), axes.end(), axis) - axes.begin());
      const int f = on->factor_of_axis[pos];
      if (factor < 0) {
        factor = f;
        source = s;
        for (std::size_t i = 0; i < pos; ++i)
          if (on->factor_of_axis[i] == f) before.push_back(axes[i]);
      } else if (f != factor) {  // the later tactic's decision is the one that cannot go on
        auto wanted = origin(v, axis), existing = origin(n.slots[source], axis);
        if (wanted.tactic < existing.tactic) std::swap(wanted, existing);
        return conflict(axis, node, wanted, existing);
      }
    }
    if (factor < 0) return carry_partial(n, axis);

    const Origin from = origin(n.slots[source], axis);
    const Factor& kind = n.rule.factors[static_cast<std::size_t>(factor)];
    for (std::size_t s = 0; s < n.slots.size(); ++s) {
      const ValueId v = n.slots[s];
      if ((value(v).partial & bit(axis)) && !(s == result && kind.kind == FactorKind::reduction))
        return stop(axis, node, from, partial_reason(v, axis));
    }
    if (kind.kind == FactorKind::need_replication) return stop(axis, node, from, kind.why);

    // 2. Every other tensor holding the factor takes the axis, or none does.
    std::vector<std::pair<ValueId, std::int64_t>> targets;
    for (std::size_t s = 0; s < n.slots.size(); ++s) {
      if (s == result && kind.kind == FactorKind::reduction) continue;
      const ValueId v = n.slots[s];
      const auto e = OpRule::dim_of(n.dims(s), factor);
      if (e < 0) continue;
      if (const auto* p = find(v, axis); p && p->dim == e) continue;
      if (std::find_if(targets.begin(), targets.end(), [&](const auto& t) { return t.first == v; }) != targets.end()) continue;
      if (auto block = check(n, s, e, factor, before, axis)) {
        if (block->existing) return conflict(axis, node, from, *block->existing, block->reason);
        return stop(axis, node, from, block->reason);
      }
      targets.emplace_back(v, e);
    }
    bool to_partial = false;
    if (kind.kind == FactorKind::reduction && n.has_result) {
      const auto* p = find(n.slots[result], axis);
      if (p && p->dim == replicated_dim) return conflict(axis, node, from, origin(n.slots[result], axis));
      to_partial = !p;
    }
    for (const auto& [v, e] : targets) {
      place(v, axis, e, {axis, e, current(), n.via, n.site, n.slots[source], from.dim});
      enqueue_users(v);
    }
    if (to_partial) {
      place(n.slots[result], axis, partial_dim, {axis, partial_dim, current(), n.via, n.site, n.slots[source], from.dim});
      enqueue_users(n.slots[result]);
    }
  }

  // No operand tiles `axis` here: the result is a partial sum over it if the op is linear in the operands
  // that are (OpRule::partial).
  void carry_partial(const Node& n, int axis) {
    if (!n.has_result) return;
    const ValueId result = n.slots.back();
    if (value(result).used & bit(axis)) return;
    const auto& r = n.rule;
    int partial = 0, linear_partial = 0;
    bool others_clear = true;  // operands outside the linear set do not use the axis
    std::size_t first = 0;
    for (std::size_t s = 0; s + 1 < n.slots.size(); ++s) {
      if (!(value(n.slots[s]).partial & bit(axis))) continue;
      if (!partial++) first = s;
      if (r.linear.size() > s && r.linear[s]) ++linear_partial;
      else others_clear = false;
    }
    if (!partial || !others_clear) return;
    const auto linear_count = static_cast<int>(std::count(r.linear.begin(), r.linear.end(), true));
    const bool keeps = (r.partial == PartialRule::sum && linear_partial == linear_count) ||
                       (r.partial == PartialRule::product && linear_partial == 1);
    if (!keeps) return;
    place(result, axis, partial_dim, {axis, partial_dim, current(), n.via, n.site, n.slots[first], partial_dim});
    enqueue_users(result);
  }

  std::shared_ptr<const Graph> graph_;
  std::vector<ValueState> values_;
  std::vector<std::string> tactics_;
  std::vector<Conflict> conflicts_;
  std::vector<Stop> stops_;
  std::optional<PipelineStages> pipeline_;
  // (node or -1, axis, wanted value, wanted dim, existing value, existing dim) already reported.
  std::set<std::tuple<int, int, ValueId, std::int64_t, ValueId, std::int64_t>> reported_;
  std::vector<std::pair<int, ValueId>> pending_;  // (axis, value) placed since the last propagate()
  std::deque<int> queue_;
  std::vector<char> queued_;
};

}  // namespace partir

#pragma once
// Elementwise fusion plan: which ops of a program run together in one blocked loop (fused_kernel.hpp)
// instead of one pass over memory each. A group is a DAG of elementwise ops (unary, binary, compare,
// select) of one float dtype whose inner values feed ops of the group and nothing else (a value read by
// several of them is computed once); its root's result is the only buffer it writes. A broadcast_in_dim
// whose every user is in some group is never materialized: the groups read its operand through an index pattern instead (a scalar, a row repeated, a
// column stretched); nor is a convert from 16 bits to f32 (a mixed-precision gradient entering the f32
// update): the groups widen its operand as they load it. Everything else runs op by op. Pure IR analysis:
// the executor, the interpreter and the simulator (for memory) all read the same plan.
//
// Fused results are bitwise equal to unfused ones: each op still computes every element with the same
// fixed-size vector code (kernels::blockwise), only without the round trip through memory in between (a
// 16-bit group keeps f32 between its steps and rounds what it stores, fused_kernel.hpp).
// Set PARTIR_FUSION=0 in the environment (or call set_fusion(false)) to run every op by itself.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <optional>
#include <ranges>
#include <string>
#include <vector>

#include "partir/config.hpp"
#include "partir/ir/program.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

namespace detail {
inline std::atomic<bool>& fusion_enabled() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("PARTIR_FUSION");
    return !(v && *v == '0');
  }()};
  return on;
}
}  // namespace detail

inline bool fusion_enabled() { return detail::fusion_enabled(); }
// Applies to the plans made afterwards (each run makes its own).
inline void set_fusion(bool on) { detail::fusion_enabled() = on; }

// A group input: value `value` read at element (i / div) % mod for element i of the group (mod 0: i itself),
// widened as it is loaded where it is 16-bit and the group f32.
struct FusedInput {
  ValueId value = -1;
  std::int64_t div = 1, mod = 0;
  friend bool operator==(const FusedInput&, const FusedInput&) = default;
};

// One op of a group. Its arguments are group inputs (arg < 0: input -1 - arg) or earlier steps (arg >= 0).
struct FusedStep {
  ValueId value = -1;
  OpKind kind = OpKind::add;
  CompareDir cmp = CompareDir::eq;
  std::vector<int> args;
  friend bool operator==(const FusedStep&, const FusedStep&) = default;
};

struct FusionGroup {
  ValueId root = -1;            // the last step; the group's only result
  TensorType type;              // of the root
  std::vector<FusedInput> inputs;
  std::vector<FusedStep> steps;  // in program order
};

class FusionPlan {
 public:
  // The group whose root is v, or null.
  const FusionGroup* group_at(ValueId v) const {
    const int g = root_of_[static_cast<std::size_t>(v)];
    return g < 0 ? nullptr : &groups_[static_cast<std::size_t>(g)];
  }
  // v is computed inside a group (or read through a pattern) and never gets a buffer of its own.
  bool skipped(ValueId v) const { return skipped_[static_cast<std::size_t>(v)] != 0; }
  // How many groups compute v: 0 outside groups, more than 1 where groups compute it again each.
  int copies(ValueId v) const { return copies_[static_cast<std::size_t>(v)]; }
  const std::vector<FusionGroup>& groups() const { return groups_; }
  // As Program::last_uses, with each group's inputs used at its root and skipped values used nowhere.
  const std::vector<std::vector<ValueId>>& last_uses() const { return last_uses_; }

  // `size` values; op(v) gives each one's Op (its operands count as uses); computed(v) says whether v is
  // a local computation the plan may fuse (false for inputs, collectives and other special instructions).
  FusionPlan(std::int64_t size, const std::function<const Op&(ValueId)>& op,
             const std::function<bool(ValueId)>& computed, const std::vector<ValueId>& outputs, bool fuse);

 private:
  std::vector<FusionGroup> groups_;
  std::vector<int> root_of_;
  std::vector<char> skipped_;
  std::vector<int> copies_;
  std::vector<std::vector<ValueId>> last_uses_;
};

// One line per group: "%root = kind(args) ..." with inputs as %value, a broadcast pattern as %value/div%mod.
PARTIR_ENTRY std::string to_string(const FusionPlan& plan);

// The plan for a whole program on one device.
PARTIR_ENTRY FusionPlan plan_fusion(const Program& p);

// The plan for one device's SpmdProgram: collectives and row-sharded gathers run by themselves.
PARTIR_ENTRY FusionPlan plan_fusion(const SpmdProgram& p);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

// A member is computed again in at most this many groups; past that it is stored once and read.
inline constexpr std::size_t kMaxCopies = 4;

inline bool fusable_kind(OpKind k) {
  return (is_elementwise(k) && k != OpKind::convert) || k == OpKind::compare || k == OpKind::select;
}

// The index pattern of broadcast_in_dim x -> result, if its element i reads x at (i / div) % mod.
inline std::optional<FusedInput> broadcast_pattern(const Shape& x, const Op& b) {
  const Shape& r = b.type.shape;
  std::int64_t first = -1, last = -1;  // the result dims the operand's non-unit dims land on
  for (std::size_t j = 0; j < x.size(); ++j) {
    if (x[j] == 1) continue;
    const auto d = b.attrs.dims[j];
    if (r[static_cast<std::size_t>(d)] != x[j]) return std::nullopt;
    if (first < 0) first = d;
    else if (d != last + 1) {  // a gap: only unit result dims may sit between
      for (auto k = last + 1; k < d; ++k)
        if (r[static_cast<std::size_t>(k)] != 1) return std::nullopt;
    }
    last = d;
  }
  FusedInput in{b.operands[0], 1, 1};
  if (first < 0) return in;  // one element
  for (auto k = last + 1; k < static_cast<std::int64_t>(r.size()); ++k) in.div *= r[static_cast<std::size_t>(k)];
  in.mod = num_elements(x);
  return in;
}

// A convert from 16 bits to f32 is exact: a group reads its operand widened, tile by tile.
inline bool widens_exactly(DType from, DType to) { return is_half(from) && to == DType::f32; }

}  // namespace detail

PARTIR_ENTRY FusionPlan::FusionPlan(std::int64_t size, const std::function<const Op&(ValueId)>& op,
                                    const std::function<bool(ValueId)>& computed, const std::vector<ValueId>& outputs,
                                    bool fuse)
    : root_of_(static_cast<std::size_t>(size), -1), skipped_(static_cast<std::size_t>(size), 0),
      copies_(static_cast<std::size_t>(size), 0), last_uses_(static_cast<std::size_t>(size)) {
  const auto n = static_cast<std::size_t>(size);
  std::vector<char> is_output(n, 0);
  for (auto o : outputs) is_output[static_cast<std::size_t>(o)] = 1;
  std::vector<std::vector<ValueId>> users(n);  // distinct consumers, ascending
  for (ValueId v = 0; v < size; ++v)
    for (auto o : op(v).operands) {
      auto& u = users[static_cast<std::size_t>(o)];
      if (u.empty() || u.back() != v) u.push_back(v);
    }

  if (fuse) {
    auto member = [&](ValueId v) {
      const Op& o = op(v);
      if (!computed(v) || !detail::fusable_kind(o.kind) || !is_float(o.type.dtype)) return false;
      for (auto a : o.operands)
        if (op(a).type.dtype != o.type.dtype || op(a).type.elements() != o.type.elements()) return false;
      return true;
    };
    // Walking backwards, a member whose users are all in groups joins each of them: one group computes it once
    // for all its readers there; several groups each compute it again (XLA's producer duplication), so it is
    // never stored and the groups read its operands instead, as a backward pass recomputes an activation's
    // elementwise tail from the one value it keeps. Any other member roots a new group.
    std::vector<std::vector<int>> groups_of(n);  // ascending
    int groups = 0;
    for (ValueId v = size; v-- > 0;) {
      if (!member(v)) continue;
      std::vector<int> joined;
      bool joins = !is_output[static_cast<std::size_t>(v)] && !users[static_cast<std::size_t>(v)].empty();
      for (auto u : users[static_cast<std::size_t>(v)]) {
        const auto& g = groups_of[static_cast<std::size_t>(u)];
        joins &= !g.empty();
        joined.insert(joined.end(), g.begin(), g.end());
      }
      std::ranges::sort(joined);
      joined.erase(std::unique(joined.begin(), joined.end()), joined.end());
      if (!joins || joined.size() > detail::kMaxCopies) joined = {groups++};
      groups_of[static_cast<std::size_t>(v)] = std::move(joined);
    }
    // v's step in group g, where v is computed in g.
    std::vector<std::vector<int>> step_of(n);  // one per group of groups_of, in the same order
    auto step_in = [&](ValueId v, int g) -> std::optional<int> {
      const auto& gs = groups_of[static_cast<std::size_t>(v)];
      const auto it = std::ranges::lower_bound(gs, g);
      if (it == gs.end() || *it != g) return std::nullopt;
      return step_of[static_cast<std::size_t>(v)][static_cast<std::size_t>(it - gs.begin())];
    };
    // Broadcasts and widening converts read through a pattern: every user is a member and the pattern exists.
    std::vector<std::optional<FusedInput>> pattern(n);
    for (ValueId v = 0; v < size; ++v) {
      const Op& o = op(v);
      if (!computed(v) || is_output[static_cast<std::size_t>(v)] || users[static_cast<std::size_t>(v)].empty()) continue;
      bool all_members = true;
      for (auto u : users[static_cast<std::size_t>(v)]) all_members &= !groups_of[static_cast<std::size_t>(u)].empty();
      if (!all_members) continue;
      if (o.kind == OpKind::broadcast_in_dim)
        pattern[static_cast<std::size_t>(v)] = detail::broadcast_pattern(op(o.operands[0]).type.shape, o);
      else if (o.kind == OpKind::convert && detail::widens_exactly(op(o.operands[0]).type.dtype, o.type.dtype))
        pattern[static_cast<std::size_t>(v)] = FusedInput{o.operands[0]};
    }
    // Build the groups in program order.
    std::vector<FusionGroup> built(static_cast<std::size_t>(groups));
    std::vector<char> patterned(static_cast<std::size_t>(groups), 0);
    for (ValueId v = 0; v < size; ++v) {
      const auto& in = groups_of[static_cast<std::size_t>(v)];
      for (std::size_t k = 0; k < in.size(); ++k) {
        const int g = in[k];
        FusionGroup& grp = built[static_cast<std::size_t>(g)];
        const Op& o = op(v);
        FusedStep s{v, o.kind, o.attrs.cmp, {}};
        for (auto a : o.operands) {
          if (const auto step = step_in(a, g)) {
            s.args.push_back(*step);
            continue;
          }
          const auto& pat = pattern[static_cast<std::size_t>(a)];
          patterned[static_cast<std::size_t>(g)] |= pat.has_value();
          const FusedInput fi = pat ? *pat : FusedInput{a};
          auto it = std::find(grp.inputs.begin(), grp.inputs.end(), fi);
          if (it == grp.inputs.end()) it = grp.inputs.insert(grp.inputs.end(), fi);
          s.args.push_back(-1 - static_cast<int>(it - grp.inputs.begin()));
        }
        step_of[static_cast<std::size_t>(v)].push_back(static_cast<int>(grp.steps.size()));
        grp.steps.push_back(std::move(s));
        grp.root = v;
        grp.type = o.type;
      }
    }
    for (std::size_t g = built.size(); g-- > 0;) {  // numbered walking backwards: ascending roots
      FusionGroup& grp = built[g];
      // A lone op gains nothing, unless it reads a pattern or is 16-bit: the plain kernel would widen whole
      // operands to f32 copies, the group widens a tile at a time in registers.
      if (grp.steps.size() < 2 && !patterned[g] && !is_half(grp.type.dtype)) continue;
      for (const auto& s : grp.steps) {
        ++copies_[static_cast<std::size_t>(s.value)];
        if (s.value != grp.root) skipped_[static_cast<std::size_t>(s.value)] = 1;
      }
      root_of_[static_cast<std::size_t>(grp.root)] = static_cast<int>(groups_.size());
      groups_.push_back(std::move(grp));
    }
    // A patterned broadcast or convert is skipped once every user is in a group that was kept; otherwise it
    // is materialized after all, and the groups read the pattern anyway (same values).
    for (ValueId v = 0; v < size; ++v) {
      if (!pattern[static_cast<std::size_t>(v)]) continue;
      bool all_fused = true;
      for (auto u : users[static_cast<std::size_t>(v)])
        all_fused &= skipped_[static_cast<std::size_t>(u)] || root_of_[static_cast<std::size_t>(u)] >= 0;
      if (all_fused) skipped_[static_cast<std::size_t>(v)] = 1;
    }
  }

  // Liveness as run: a group root uses its inputs, a skipped value uses nothing, anything else its operands.
  std::vector<ValueId> last(n, -1);
  for (ValueId v = 0; v < size; ++v) {
    if (skipped(v)) continue;
    if (const FusionGroup* g = group_at(v))
      for (const auto& in : g->inputs) last[static_cast<std::size_t>(in.value)] = v;
    else
      for (auto o : op(v).operands) last[static_cast<std::size_t>(o)] = v;
  }
  for (auto o : outputs) last[static_cast<std::size_t>(o)] = static_cast<ValueId>(size);
  for (ValueId v = 0; v < size; ++v) {
    auto& l = last[static_cast<std::size_t>(v)];
    if (skipped(v)) continue;
    if (l < 0) l = v;
    if (l < size) last_uses_[static_cast<std::size_t>(l)].push_back(v);
  }
}

PARTIR_ENTRY std::string to_string(const FusionPlan& plan) {
  std::string s;
  for (const auto& g : plan.groups()) {
    s += "%" + std::to_string(g.root) + " <-";
    for (const auto& step : g.steps) {
      s += " " + std::string(name_of(step.kind)) + "(";
      for (std::size_t i = 0; i < step.args.size(); ++i) {
        const int a = step.args[i];
        if (i) s += ",";
        if (a >= 0) {
          s += "%" + std::to_string(g.steps[static_cast<std::size_t>(a)].value);
          continue;
        }
        const FusedInput& in = g.inputs[static_cast<std::size_t>(-1 - a)];
        s += "%" + std::to_string(in.value);
        if (in.mod) s += "/" + std::to_string(in.div) + "%" + std::to_string(in.mod);
      }
      s += ")";
    }
    s += "\n";
  }
  return s;
}

PARTIR_ENTRY FusionPlan plan_fusion(const Program& p) {
  std::vector<ValueId> outputs;
  for (const auto& o : p.outputs()) outputs.push_back(o.value);
  return FusionPlan(
      p.size(), [&](ValueId v) -> const Op& { return p.op(v); },
      [&](ValueId v) { return p.op(v).kind != OpKind::input; }, outputs, fusion_enabled());
}

PARTIR_ENTRY FusionPlan plan_fusion(const SpmdProgram& p) {
  std::vector<ValueId> outputs;
  for (const auto& o : p.outputs()) outputs.push_back(o.value);
  return FusionPlan(
      p.size(), [&](ValueId v) -> const Op& { return p.op(v).op; },
      [&](ValueId v) {
        const SpmdOp& s = p.op(v);
        return s.op.kind != OpKind::input && !s.collective && s.row_shard.empty();
      },
      outputs, fusion_enabled());
}
#endif

}  // namespace partir

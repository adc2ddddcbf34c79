#pragma once
// Elementwise fusion plan: which ops of a program run together in one blocked loop (fused_kernel.hpp)
// instead of one pass over memory each. A group is a DAG of elementwise ops (unary, binary, compare,
// select) of one float dtype whose inner values feed ops of the group and nothing else (a value read by
// several of them is computed once); its root's result is the only buffer it writes. A broadcast_in_dim
// whose every user is in some group is never materialized: the groups read its operand through an index
// pattern instead (a scalar, a row repeated, a column stretched); nor is a convert from 16 bits to f32 (a
// mixed-precision gradient entering the f32 update): the groups widen its operand as they load it. A convert
// from f32 to 16 bits ends a group of f32 steps, which stores its result narrowed (the f32 list's results
// returning to the compute dtype). A group that reads what an earlier group stores computes that group's
// steps itself and stores those values as side outputs (multi-output fusion, below). Everything else runs op
// by op. Pure IR analysis: the executor, the interpreter and the simulator (for memory) all read the same plan.
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
  ValueId root = -1;             // the last step: the group runs where the program computes it
  TensorType type;               // of the root
  std::vector<FusedInput> inputs;
  std::vector<FusedStep> steps;  // each after the steps it reads
  std::vector<int> side_outputs;  // steps before the root whose values the group stores too, ascending
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
  // Where v's buffer is written: v itself, or the root of the group that stores v as a side output.
  ValueId made_at(ValueId v) const { return made_at_[static_cast<std::size_t>(v)]; }
  // Something runs at v: its own op, or the group rooted there.
  bool runs_at(ValueId v) const { return !skipped(v) && made_at(v) == v; }
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
  void merge_stored_reads(std::int64_t size, const std::function<const Op&(ValueId)>& op,
                          const std::vector<ValueId>& outputs);

  std::vector<FusionGroup> groups_;
  std::vector<int> root_of_;
  std::vector<char> skipped_;
  std::vector<ValueId> made_at_;
  std::vector<int> copies_;
  std::vector<std::vector<ValueId>> last_uses_;
};

// One line per group: "%root <- kind(args) ..." with inputs as %value, a broadcast pattern as %value/div%mod,
// then "stores %v ..." for its side outputs.
PARTIR_ENTRY std::string to_string(const FusionPlan& plan);

// The plan for a whole program on one device.
PARTIR_ENTRY FusionPlan plan_fusion(const Program& p);

// The plan for one device's SpmdProgram: collectives and row-sharded gathers run by themselves; with fuse false,
// every op by itself.
PARTIR_ENTRY FusionPlan plan_fusion(const SpmdProgram& p, bool fuse = fusion_enabled());

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
// A convert from f32 to 16 bits rounds as a 16-bit group's store does: it roots a group of the f32 steps before
// it (the f32 list's softmax or layer norm handing its result back in the compute dtype), which computes them in
// f32 registers as ever and stores only the narrowed result.
inline bool narrows_at_store(DType from, DType to) { return from == DType::f32 && is_half(to); }

}  // namespace detail

PARTIR_ENTRY FusionPlan::FusionPlan(std::int64_t size, const std::function<const Op&(ValueId)>& op,
                                    const std::function<bool(ValueId)>& computed, const std::vector<ValueId>& outputs,
                                    bool fuse)
    : root_of_(static_cast<std::size_t>(size), -1), skipped_(static_cast<std::size_t>(size), 0),
      made_at_(static_cast<std::size_t>(size)), copies_(static_cast<std::size_t>(size), 0), last_uses_(static_cast<std::size_t>(size)) {
  const auto n = static_cast<std::size_t>(size);
  for (ValueId v = 0; v < size; ++v) made_at_[static_cast<std::size_t>(v)] = v;
  std::vector<char> is_output(n, 0);
  for (auto o : outputs) is_output[static_cast<std::size_t>(o)] = 1;
  std::vector<std::vector<ValueId>> users(n);  // distinct consumers, ascending
  for (ValueId v = 0; v < size; ++v)
    for (auto o : op(v).operands) {
      auto& u = users[static_cast<std::size_t>(o)];
      if (u.empty() || u.back() != v) u.push_back(v);
    }

  if (fuse) {
    auto narrowing = [&](ValueId v) {
      const Op& o = op(v);
      return o.kind == OpKind::convert && detail::narrows_at_store(op(o.operands[0]).type.dtype, o.type.dtype);
    };
    auto member = [&](ValueId v) {
      const Op& o = op(v);
      if (!computed(v)) return false;
      if (narrowing(v)) return true;
      if (!detail::fusable_kind(o.kind) || !is_float(o.type.dtype)) return false;
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
      bool joins =
          !narrowing(v) && !is_output[static_cast<std::size_t>(v)] && !users[static_cast<std::size_t>(v)].empty();
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
      // operands to f32 copies, the group widens a tile at a time in registers. A lone convert is convert's kernel.
      if (grp.steps.size() < 2 && (grp.steps[0].kind == OpKind::convert || (!patterned[g] && !is_half(grp.type.dtype))))
        continue;
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
    merge_stored_reads(size, op, outputs);
  }

  // Liveness as run: a group root uses its inputs, a skipped value or a side output uses nothing, anything else
  // its operands. A side output lives from its group's root.
  std::vector<ValueId> last(n, -1);
  for (ValueId v = 0; v < size; ++v) {
    if (!runs_at(v)) continue;
    if (const FusionGroup* g = group_at(v))
      for (const auto& in : g->inputs) last[static_cast<std::size_t>(in.value)] = v;
    else
      for (auto o : op(v).operands) last[static_cast<std::size_t>(o)] = v;
  }
  for (auto o : outputs) last[static_cast<std::size_t>(o)] = static_cast<ValueId>(size);
  for (ValueId v = 0; v < size; ++v) {
    auto& l = last[static_cast<std::size_t>(v)];
    if (skipped(v)) continue;
    l = std::max(l, made_at(v));
    if (l < size) last_uses_[static_cast<std::size_t>(l)].push_back(v);
  }
}

// Multi-output fusion (XLA's producer-consumer kind): a group C that reads what an earlier group P stores, element
// for element, computes P's steps first and stores P's values itself, when every other reader of them runs after
// C: one pass over memory instead of two, and those values never read back (Adam's m and v, read by its
// parameter update). It must not raise the peak: P's inputs now live until C, so those that died at P may not
// outweigh P's stored values, which C no longer holds in between. The nearest producer is taken first: its values
// then no longer sit between C and the next one.
PARTIR_ENTRY void FusionPlan::merge_stored_reads(std::int64_t size, const std::function<const Op&(ValueId)>& op,
                                                 const std::vector<ValueId>& outputs) {
  const auto n = static_cast<std::size_t>(size);
  auto at = [](auto& vec, ValueId v) -> auto& { return vec[static_cast<std::size_t>(v)]; };
  // Where each value is read as the plan runs (ascending; `size`: a program output), and which group stores it.
  std::vector<std::vector<ValueId>> readers(n);
  auto reads = [&](ValueId reader, ValueId v) {
    auto& r = at(readers, v);
    if (std::ranges::find(r, reader) == r.end()) r.insert(std::ranges::upper_bound(r, reader), reader);
  };
  std::vector<int> stored_by(n, -1);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (const auto& in : groups_[g].inputs) reads(groups_[g].root, in.value);
    at(stored_by, groups_[g].root) = static_cast<int>(g);
  }
  for (ValueId v = 0; v < size; ++v)
    if (!skipped(v) && !group_at(v))
      for (auto o : op(v).operands) reads(v, o);
  for (auto o : outputs) reads(static_cast<ValueId>(size), o);

  auto stored = [](const FusionGroup& g) {
    std::vector<ValueId> s{g.root};
    for (int k : g.side_outputs) s.push_back(g.steps[static_cast<std::size_t>(k)].value);
    return s;
  };
  auto bytes = [&](ValueId v) { return op(v).type.bytes(); };
  auto mergeable = [&](const FusionGroup& p, const FusionGroup& c) {
    if (p.type != c.type) return false;
    std::int64_t kept = 0, extended = 0;
    for (ValueId x : stored(p)) {
      kept += bytes(x);
      for (const auto& in : c.inputs)
        if (in.value == x && in.mod != 0) return false;
      for (ValueId r : at(readers, x))
        if (r < c.root) return false;
    }
    std::vector<ValueId> seen;
    for (const auto& in : p.inputs) {
      const Op& o = op(in.value);
      const bool program_input = o.kind == OpKind::input && o.operands.empty();
      if (program_input || std::ranges::find(seen, in.value) != seen.end()) continue;
      seen.push_back(in.value);
      if (at(readers, in.value).back() == p.root) extended += bytes(in.value);
    }
    return extended <= kept;
  };
  // c computes p's steps first; c's reads of p's values become reads of those steps.
  auto merge = [&](FusionGroup& p, FusionGroup& c) {
    const auto p_values = stored(p);
    const int shift = static_cast<int>(p.steps.size());
    std::vector<int> arg_of_input;  // c's input k -> its argument in the merged group
    for (const auto& in : c.inputs) {
      if (std::ranges::find(p_values, in.value) != p_values.end()) {
        const auto step = std::ranges::find_if(p.steps, [&](const FusedStep& s) { return s.value == in.value; });
        arg_of_input.push_back(static_cast<int>(step - p.steps.begin()));
        continue;
      }
      auto it = std::ranges::find(p.inputs, in);
      if (it == p.inputs.end()) it = p.inputs.insert(p.inputs.end(), in);
      arg_of_input.push_back(-1 - static_cast<int>(it - p.inputs.begin()));
    }
    for (auto& s : c.steps)
      for (int& a : s.args) a = a < 0 ? arg_of_input[static_cast<std::size_t>(-1 - a)] : a + shift;
    p.side_outputs.push_back(shift - 1);
    for (int k : c.side_outputs) p.side_outputs.push_back(k + shift);
    p.steps.insert(p.steps.end(), std::make_move_iterator(c.steps.begin()), std::make_move_iterator(c.steps.end()));
    c.steps = std::move(p.steps);
    c.inputs = std::move(p.inputs);
    c.side_outputs = std::move(p.side_outputs);
  };

  std::vector<char> merged(groups_.size(), 0);
  for (std::size_t c = 0; c < groups_.size(); ++c) {
    FusionGroup& into = groups_[c];
    while (true) {
      int nearest = -1;  // the producer with the latest root among those c reads
      for (const auto& in : into.inputs) {
        const int g = at(stored_by, in.value);
        if (g >= 0 && g != static_cast<int>(c) && !merged[static_cast<std::size_t>(g)] &&
            (nearest < 0 || groups_[static_cast<std::size_t>(g)].root > groups_[static_cast<std::size_t>(nearest)].root) &&
            mergeable(groups_[static_cast<std::size_t>(g)], into))
          nearest = g;
      }
      if (nearest < 0) break;
      FusionGroup& from = groups_[static_cast<std::size_t>(nearest)];
      for (ValueId x : stored(from)) {
        at(made_at_, x) = into.root;
        at(stored_by, x) = static_cast<int>(c);
        std::erase(at(readers, x), into.root);
      }
      for (const auto& in : from.inputs) {
        std::erase(at(readers, in.value), from.root);
        reads(into.root, in.value);
      }
      at(root_of_, from.root) = -1;
      merge(from, into);
      merged[static_cast<std::size_t>(nearest)] = 1;
    }
  }
  std::vector<FusionGroup> kept;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    if (!merged[g]) {
      at(root_of_, groups_[g].root) = static_cast<int>(kept.size());
      kept.push_back(std::move(groups_[g]));
    }
  groups_ = std::move(kept);
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
    if (!g.side_outputs.empty()) s += " stores";
    for (int k : g.side_outputs) s += " %" + std::to_string(g.steps[static_cast<std::size_t>(k)].value);
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

PARTIR_ENTRY FusionPlan plan_fusion(const SpmdProgram& p, bool fuse) {
  std::vector<ValueId> outputs;
  for (const auto& o : p.outputs()) outputs.push_back(o.value);
  return FusionPlan(
      p.size(), [&](ValueId v) -> const Op& { return p.op(v).op; },
      [&](ValueId v) {
        const SpmdOp& s = p.op(v);
        return s.op.kind != OpKind::input && !s.collective && s.row_shard.empty();
      },
      outputs, fuse);
}
#endif

}  // namespace partir

#pragma once
// lower(partitioned) -> SpmdProgram. Each op runs on the tiles its result's sharding implies: the result's
// axes fix how its factors are tiled (the op's rule in sharding/rules.hpp), partial-sum axes come from tiled
// reduction factors or from operands the op is linear in, and every operand is resharded to what those
// factors require. Resharding an operand, in this order:
//   1. partial sums no longer wanted: reduce_scatter where the same axes are to tile a dim, else all_reduce;
//   2. axes to add that are free on the value: all_slice (local, and it shrinks what follows);
//   3. axes to remove (the minor end of a dim): all_gather, fused with a following all_slice of the same
//      axis on another dim into one all_to_all;
//   4. the remaining axes to add: all_slice.
// A partial sum stays partial through a linear op only if that op is its one use; a partial sum with several
// uses is reduced once where it is made (a gradient feeding Adam's m and v is all-reduced once, not twice).
// Reshards are cached per (value, layout), so two uses wanting the same layout share one collective; a
// parameter's reshards (and its cast to a mixed-precision compute dtype's) are cached per pass, so the backward
// pass gathers a ZeRO-3 parameter again instead of holding the forward pass's gathered copy through it (as
// the ZeRO paper schedules it: 1.5x DP's bytes).
// Where the result's sharding cannot be computed locally (an axis straddling a reshape's factors, a tiled
// dim a slice or concatenate changes), the op runs with those axes replicated and later uses reshard.
// A convolution with tiled spatial dims first brings each tile its halo from the neighbouring tiles
// (collective_permute, sharding/halo.hpp).
#include <map>

#include "partir/config.hpp"
#include "partir/sharding/halo.hpp"
#include "partir/sharding/partitioned.hpp"
#include "partir/sharding/rules.hpp"
#include "partir/spmd/bucket.hpp"
#include "partir/spmd/pipeline.hpp"
#include "partir/spmd/schedule.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// What lowering does beyond the plan's own collectives.
struct LowerOptions {
  std::int64_t bucket_bytes = 0;  // fuse smaller all_reduces, reduce_scatters and all_gathers into buckets of this size (bucket.hpp); 0: off
  // Collectives moved up to where their operands are ready, for the executor's communication stream to overlap
  // with the ops in between; a move that keeps a larger result alive longer stays within prefetch_bytes of such
  // results in flight (schedule.hpp; one_collective_ahead: the largest one's).
  bool early_collectives = true;
  std::int64_t prefetch_bytes = one_collective_ahead;
  friend bool operator==(const LowerOptions&, const LowerOptions&) = default;
};

PARTIR_ENTRY SpmdProgram lower(const Partitioned& plan, const LowerOptions& options = {});

#if PARTIR_DEFINE_ENTRIES
namespace detail {

class Lowering {
 public:
  explicit Lowering(const Partitioned& plan)
      : plan_(plan), prog_(plan.program()), mesh_(plan.mesh()), out_(prog_.name(), mesh_),
        local_(static_cast<std::size_t>(prog_.size()), -1), uses_(use_counts(prog_)),
        users_(static_cast<std::size_t>(prog_.size())), recomputed_(static_cast<std::size_t>(prog_.size()), 0) {
    for (ValueId v = 0; v < prog_.size(); ++v)
      for (auto o : prog_.op(v).operands) users_[static_cast<std::size_t>(o)].push_back(v);
    for (const auto& r : prog_.recomputes()) recomputed_[static_cast<std::size_t>(r.value)] = 1;
  }

  SpmdProgram run() {
    const ValueId backward = prog_.backward_start().value_or(prog_.size());
    if (pipeline_) check_pipeline_axis();
    for (ValueId v = 0; v < prog_.size(); ++v) {
      in_backward_pass_ = v >= backward;
      at(v);
      lower_op(v);
    }
    for (const auto& o : prog_.outputs()) {
      at(o.value);
      Sharding target = layout_of(local_[static_cast<std::size_t>(o.value)]);
      target.partial.clear();  // outputs are whole values: resolve partial sums
      if (!o.updates.empty()) target = layout_of(local_[static_cast<std::size_t>(prog_.input(o.updates))]);
      const auto v = reshard(o.value, target, "output '" + o.name + "'");
      out_.add_output({o.name, v, prog_.type(o.value), target, o.updates});
    }
    if (pipeline_) return cut_into_stages(std::move(out_), source_, prog_, *pipeline_);
    return std::move(out_);
  }

 private:
  // The planned sharding without axes of size 1: they cut nothing, so they never cost a collective.
  Sharding planned(ValueId v) const {
    Sharding s = plan_.sharding(v);
    auto drop = [&](AxisList& axes) { std::erase_if(axes, [&](const auto& a) { return mesh_.axis_size(a) == 1; }); };
    for (auto& d : s.dims) drop(d);
    drop(s.partial);
    return s;
  }

  const Sharding& layout_of(ValueId spmd_value) const { return layouts_.at(static_cast<std::size_t>(spmd_value)); }

  ValueId emit(Op op, Sharding layout, std::optional<Collective> c = std::nullopt, AxisList row_shard = {}) {
    layouts_.push_back(std::move(layout));
    source_.push_back(current_);
    return out_.add({std::move(op), std::move(c), std::move(row_shard), stage_,
                     recomputed_[static_cast<std::size_t>(current_)] != 0});
  }

  // What is lowered next is global value v's (or an output of it): emitted ops run on v's stage.
  void at(ValueId v) {
    current_ = v;
    if (pipeline_) stage_ = pipeline_->stage[static_cast<std::size_t>(v)];
  }

  // A pipeline axis carries stages; no tactic may tile a value on it (whichever comes first in the schedule).
  void check_pipeline_axis() const {
    const int a = mesh_.find_axis(pipeline_->axis);
    for (ValueId v = 0; v < prog_.size(); ++v) {
      if (!plan_.sharding(v).uses(pipeline_->axis)) continue;
      std::string by = "a tactic";
      for (const auto& o : plan_.provenance(v))
        if (o.axis == a && o.tactic >= 0) by = plan_.state().tactic_label(o.tactic);
      user_error(pipeline_->tactic_label + ": " + by + " partitions " + prog_.label(v) + " over '" + pipeline_->axis +
                 "', the pipeline's axis (a pipeline axis carries stages; give other tactics other axes)");
    }
  }

  std::string axis_origin(ValueId v, const std::string& axis) const {
    const int a = mesh_.find_axis(axis);
    for (const auto& p : plan_.provenance(v))
      if (p.axis == a && p.tactic >= 0) return "'" + axis + "' from " + plan_.state().tactic_label(p.tactic);
    return "'" + axis + "'";
  }

  // Why `value` had to change from `from` to `to` at `site`: quoted by every collective of the reshard.
  std::string reason(ValueId value, const Sharding& from, const Sharding& to, const std::string& site) const {
    const TensorType& t = prog_.type(value);
    std::string s = site + " needs " + prog_.label(value) + " as " + to_string(t, to) + ", has " + to_string(t, from);
    AxisList changed = from.partial;
    for (std::size_t d = 0; d < from.dims.size(); ++d)
      for (const auto& a : from.dims[d])
        if (to.dim_of(a) != static_cast<std::int64_t>(d)) changed.push_back(a);
    for (std::size_t d = 0; d < to.dims.size(); ++d)
      for (const auto& a : to.dims[d])
        if (from.dim_of(a) != static_cast<std::int64_t>(d) && !from.is_partial(a)) changed.push_back(a);
    std::string origins;
    for (const auto& a : changed)
      if (origins.find("'" + a + "'") == std::string::npos) origins += (origins.empty() ? "" : ", ") + axis_origin(value, a);
    for (const auto& c : plan_.conflicts())
      if (c.wanted.value == value || c.existing.value == value) origins += (origins.empty() ? "" : "; ") + std::string("conflict: ") + c.message;
    return origins.empty() ? s : s + " (" + origins + ")";
  }

  // One collective step on the chain that reshards a value; `layout` is the result's.
  ValueId step(ValueId x, const TensorType& global, Collective c, Sharding layout) {
    Op op{OpKind::input, {x}, {}, {local_shape(global, layout, mesh_), global.dtype}, ""};
    return emit(std::move(op), std::move(layout), std::move(c));
  }

  // A parameter, or its cast (precision.hpp casts each parameter once, where the model uses it).
  bool is_parameter_copy(ValueId v) const {
    const Op& op = prog_.op(v);
    if (op.kind == OpKind::convert) return is_parameter_copy(op.operands[0]);
    return op.kind == OpKind::input && op.attrs.input_kind == InputKind::parameter;
  }

  ValueId reshard(ValueId value, const Sharding& to, const std::string& site) {
    const ValueId start = local_[static_cast<std::size_t>(value)];
    Sharding cur = layout_of(start);
    if (cur == to) return start;
    std::string key = std::to_string(value) + " " + to_string(to);
    if (is_parameter_copy(value)) key += in_backward_pass_ ? " backward" : " forward";
    if (pipeline_) key += " @" + std::to_string(stage_);  // each stage reshards what it reads
    if (auto it = reshards_.find(key); it != reshards_.end()) return it->second;
    for (const auto& p : to.partial)
      if (!cur.is_partial(p))
        internal_error("lower: " + site + " wants " + prog_.label(value) + " partial over '" + p + "' but it is not");

    const TensorType& global = prog_.type(value);
    // A scalar's broadcast is made again at the wanted tile's shape instead of sliced from a whole one (Adam's
    // constants meeting a ZeRO gradient shard): nothing is materialized whole, and the fused groups read it as
    // a pattern.
    if (const Op& op = prog_.op(value);
        op.kind == OpKind::broadcast_in_dim && cur.partial.empty() && to.partial.empty()) {
      const ValueId scalar = local_[static_cast<std::size_t>(op.operands[0])];
      if (out_.type(scalar).rank() == 0 && layout_of(scalar).partial.empty()) {
        Op local = op;
        local.operands = {scalar};
        local.type.shape = local.attrs.shape = local_shape(global, to, mesh_);
        return reshards_[key] = emit(std::move(local), to);
      }
    }
    const std::string why = reason(value, cur, to, site);
    ValueId x = start;
    auto prefix = [](const AxisList& a, const AxisList& b) {  // a is a prefix of b
      return a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin());
    };
    // 1. partial sums: fuse with a slice that adds the same axes next on some dim
    AxisList reduce;
    for (const auto& p : cur.partial)
      if (!to.is_partial(p)) reduce.push_back(p);
    // A partial sum is reduced once: a second use that wants it whole in another layout starts from the first
    // reduction and only moves data. Two different reductions (reduce_scatter here, all_reduce there) would
    // round differently, and `x == max(x)` in reduce_max's gradient could then match nothing (0/0, found by
    // the fuzzer).
    if (!reduce.empty() && to.partial.empty())
      if (auto it = resolved_.find(value); it != resolved_.end()) {
        x = it->second;
        cur = layout_of(x);
        reduce.clear();
      }
    const bool resolving = !reduce.empty() && to.partial.empty();
    for (std::size_t d = 0; d < to.dims.size() && !reduce.empty(); ++d) {
      if (!prefix(cur.dims[d], to.dims[d])) continue;
      AxisList scatter;
      for (auto i = cur.dims[d].size(); i < to.dims[d].size(); ++i) {
        auto it = std::find(reduce.begin(), reduce.end(), to.dims[d][i]);
        if (it == reduce.end()) break;
        scatter.push_back(*it);
      }
      if (scatter.empty()) continue;
      for (const auto& a : scatter) {
        reduce.erase(std::find(reduce.begin(), reduce.end(), a));
        cur.partial.erase(std::find(cur.partial.begin(), cur.partial.end(), a));
        cur.dims[d].push_back(a);
      }
      x = step(x, global, {CollectiveKind::reduce_scatter, scatter, static_cast<std::int64_t>(d), -1, why}, cur);
    }
    if (!reduce.empty()) {
      for (const auto& a : reduce) cur.partial.erase(std::find(cur.partial.begin(), cur.partial.end(), a));
      x = step(x, global, {CollectiveKind::all_reduce, reduce, -1, -1, why}, cur);
    }
    if (resolving) resolved_[value] = x;
    // 2. slices of axes the value does not use yet
    for (std::size_t d = 0; d < to.dims.size(); ++d) {
      if (!prefix(cur.dims[d], to.dims[d])) continue;
      AxisList add;
      for (auto i = cur.dims[d].size(); i < to.dims[d].size() && !cur.uses(to.dims[d][i]); ++i) add.push_back(to.dims[d][i]);
      if (add.empty()) continue;
      cur.dims[d].insert(cur.dims[d].end(), add.begin(), add.end());
      x = step(x, global, {CollectiveKind::all_slice, add, static_cast<std::int64_t>(d), -1, why}, cur);
    }
    // 3. gathers; a lone axis that moves to another dim goes there by all_to_all
    for (std::size_t d = 0; d < cur.dims.size(); ++d) {
      std::size_t keep = 0;
      while (keep < cur.dims[d].size() && keep < to.dims[d].size() && cur.dims[d][keep] == to.dims[d][keep]) ++keep;
      if (keep == cur.dims[d].size()) continue;
      AxisList removed(cur.dims[d].begin() + static_cast<std::ptrdiff_t>(keep), cur.dims[d].end());
      cur.dims[d].resize(keep);
      const std::int64_t target = removed.size() == 1 ? to.dim_of(removed[0]) : -1;
      const bool moves = target >= 0 && static_cast<std::size_t>(target) != d &&
                         prefix(cur.dims[static_cast<std::size_t>(target)], to.dims[static_cast<std::size_t>(target)]) &&
                         to.dims[static_cast<std::size_t>(target)].size() > cur.dims[static_cast<std::size_t>(target)].size() &&
                         to.dims[static_cast<std::size_t>(target)][cur.dims[static_cast<std::size_t>(target)].size()] == removed[0];
      if (moves) {
        cur.dims[static_cast<std::size_t>(target)].push_back(removed[0]);
        x = step(x, global, {CollectiveKind::all_to_all, removed, static_cast<std::int64_t>(d), target, why}, cur);
      } else {
        x = step(x, global, {CollectiveKind::all_gather, removed, static_cast<std::int64_t>(d), -1, why}, cur);
      }
    }
    // 4. the remaining slices
    for (std::size_t d = 0; d < to.dims.size(); ++d) {
      if (cur.dims[d].size() == to.dims[d].size()) continue;
      AxisList add(to.dims[d].begin() + static_cast<std::ptrdiff_t>(cur.dims[d].size()), to.dims[d].end());
      cur.dims[d] = to.dims[d];
      x = step(x, global, {CollectiveKind::all_slice, add, static_cast<std::int64_t>(d), -1, why}, cur);
    }
    if (!(cur == to)) internal_error("lower: reshard of " + prog_.label(value) + " ended at " + to_string(cur));
    reshards_[key] = x;
    return x;
  }

  // The axes of a result dim assigned to each of its factors, major to minor; nullopt if an axis straddles.
  std::optional<std::vector<AxisList>> split(const AxisList& axes, const DimFactors& factors, const OpRule& r) const {
    std::vector<std::int64_t> sizes;
    for (const auto& a : axes) sizes.push_back(mesh_.axis_size(a));
    const auto cut = split_axes(sizes, factors, r);
    if (!cut) return std::nullopt;
    std::vector<AxisList> out(factors.size());
    for (std::size_t i = 0; i < axes.size(); ++i)
      out[static_cast<std::size_t>(std::find(factors.begin(), factors.end(), cut->factor_of_axis[i]) - factors.begin())]
          .push_back(axes[i]);
    return out;
  }

  // A partial sum scaled elementwise by a value clear of p (lr * g, a loss scale's inverse) whose uses are all
  // elementwise and want the product whole: the sum is reduced before the scaling instead of after. The same
  // bytes move, and the scaling joins the uses' fused group after the collective (the update's), or runs on the
  // tiles a reduce_scatter leaves, instead of costing a pass over the whole gradient before it.
  bool scaled_after_reduction(ValueId v, const std::string& p, const OpRule& rule,
                              const std::vector<std::size_t>& partial_linear) const {
    const Op& op = prog_.op(v);
    const auto& users = users_[static_cast<std::size_t>(v)];
    if (rule.partial != PartialRule::product || !is_elementwise(op.kind) || users.empty() ||
        prog_.type(op.operands[partial_linear[0]]) != op.type)
      return false;
    return std::ranges::all_of(users, [&](ValueId u) {
      return is_elementwise(prog_.op(u).kind) && !planned(u).is_partial(p);
    });
  }

  // The partial sum over p ends at elementwise op v. If an elementwise user tiles a dim on p, v is computed
  // on those tiles too: its partial operands are then reduce-scattered rather than all-reduced and sliced.
  void place_resolved(ValueId v, const std::string& p, const OpRule& rule, Sharding& got,
                      std::vector<AxisList>& factor_axes) const {
    const TensorType& type = prog_.type(v);
    for (ValueId u : users_[static_cast<std::size_t>(v)]) {
      if (!is_elementwise(prog_.op(u).kind)) continue;
      const auto d = planned(u).dim_of(p);
      if (d < 0 || got.dims[static_cast<std::size_t>(d)].size() + 1 != planned(u).dims[static_cast<std::size_t>(d)].size() ||
          rule.result[static_cast<std::size_t>(d)].size() != 1)
        continue;
      AxisList axes = got.dims[static_cast<std::size_t>(d)];
      axes.push_back(p);
      if (axes != planned(u).dims[static_cast<std::size_t>(d)] || got.uses(p) ||
          type.shape[static_cast<std::size_t>(d)] % tile_count(axes, mesh_) != 0)
        continue;
      got.dims[static_cast<std::size_t>(d)] = axes;
      factor_axes[static_cast<std::size_t>(rule.result[static_cast<std::size_t>(d)][0])].push_back(p);
      return;
    }
  }

  // The dims summed away where v's value ends: v's one use is a reduce_sum, or a single-use elementwise chain
  // ending in one; empty otherwise.
  std::vector<std::int64_t> summed_dims(ValueId v) const {
    const auto& users = users_[static_cast<std::size_t>(v)];
    if (users.size() != 1) return {};
    const Op& user = prog_.op(users[0]);
    if (user.kind == OpKind::reduce_sum) return user.attrs.dims;
    return is_elementwise(user.kind) ? summed_dims(users[0]) : std::vector<std::int64_t>{};
  }

  // A gradient's square summed for a global norm (sum(g * g)), where g is a partial sum that another use
  // reduce-scatters (ZeRO's update): the elementwise ops up to the sum run on those tiles, reusing the
  // reduce_scatter, and the sum stays a partial sum of one element (keep_tiled_reduction) instead of
  // all-reducing the whole of g for this use alone.
  void summed_on_tiles(ValueId v, const OpRule& rule, const std::vector<Sharding>& have, Sharding& got,
                       std::vector<AxisList>& factor_axes) const {
    const auto summed = summed_dims(v);
    if (summed.empty()) return;
    const Op& op = prog_.op(v);
    auto adopt = [&](std::int64_t d, const AxisList& axes) {  // tile result dim d on axes (a superset of got's)
      const auto& factors = rule.result[static_cast<std::size_t>(d)];
      if (factors.size() != 1 || op.type.shape[static_cast<std::size_t>(d)] % tile_count(axes, mesh_) != 0) return;
      auto& mine = got.dims[static_cast<std::size_t>(d)];
      for (auto k = mine.size(); k < axes.size(); ++k) {
        if (got.uses(axes[k])) return;
        factor_axes[static_cast<std::size_t>(factors[0])].push_back(axes[k]);
      }
      mine = axes;
    };
    auto extends = [&](std::int64_t d, const AxisList& axes) {
      const auto& mine = got.dims[static_cast<std::size_t>(d)];
      return axes.size() > mine.size() && std::equal(mine.begin(), mine.end(), axes.begin());
    };
    for (std::size_t i = 0; i < have.size(); ++i) {
      // tiles the operand already holds beyond its plan (an earlier op of the chain)
      if (have[i] != planned(op.operands[i]))
        for (auto d : summed)
          if (extends(d, have[i].dims[static_cast<std::size_t>(d)])) adopt(d, have[i].dims[static_cast<std::size_t>(d)]);
      // a partial sum that a sibling use reduce-scatters on a summed dim
      for (const auto& p : have[i].partial)
        for (ValueId sibling : users_[static_cast<std::size_t>(op.operands[i])]) {
          if (sibling == v || got.uses(p)) continue;
          for (ValueId tiled : scattering(sibling, p)) {
            const Sharding s = planned(tiled);
            const auto d = s.dim_of(p);
            if (std::find(summed.begin(), summed.end(), d) == summed.end() || !extends(d, s.dims[static_cast<std::size_t>(d)]) ||
                s.dims[static_cast<std::size_t>(d)].size() != got.dims[static_cast<std::size_t>(d)].size() + 1)
              continue;
            adopt(d, s.dims[static_cast<std::size_t>(d)]);
            break;
          }
        }
    }
  }

  // The elementwise ops whose planned tiles on p say where `use` reduce-scatters its operand's partial sum
  // over p: the use itself, or if it keeps the sum partial (a scaled gradient), the uses that end it
  // (place_resolved).
  std::vector<ValueId> scattering(ValueId use, const std::string& p) const {
    if (!is_elementwise(prog_.op(use).kind)) return {};
    if (!planned(use).is_partial(p)) return {use};
    std::vector<ValueId> out;
    for (ValueId u : users_[static_cast<std::size_t>(use)])
      if (is_elementwise(prog_.op(u).kind)) out.push_back(u);
    return out;
  }

  // A reduce_sum whose operand lowering computed on more tiles than planned (summed_on_tiles) sums its tiles
  // into a partial sum: its users reduce a result smaller than the operand it would otherwise gather.
  void keep_tiled_reduction(ValueId v, const Sharding& have, Sharding& got, std::vector<AxisList>& factor_axes) const {
    const Op& op = prog_.op(v);
    if (have == planned(op.operands[0])) return;
    const OpRule rule = rule_for(prog_, v);
    for (auto e : op.attrs.dims) {
      const auto& axes = have.dims[static_cast<std::size_t>(e)];
      auto& assigned = factor_axes[static_cast<std::size_t>(rule.operands[0][static_cast<std::size_t>(e)][0])];
      if (axes.size() <= assigned.size() || !std::equal(assigned.begin(), assigned.end(), axes.begin()) ||
          std::any_of(axes.begin() + static_cast<std::ptrdiff_t>(assigned.size()), axes.end(),
                      [&](const auto& a) { return got.uses(a); }))
        continue;
      got.partial.insert(got.partial.end(), axes.begin() + static_cast<std::ptrdiff_t>(assigned.size()), axes.end());
      assigned = axes;
    }
  }

  // add_n's operands that are partial sums over the same axes, in the same layout, are added locally and
  // reduced once: a global norm costs one scalar all_reduce per group of axes, not one per term.
  std::vector<ValueId> reduced_in_groups(ValueId v, const std::vector<Sharding>& have, const std::vector<Sharding>& need) {
    const Op& op = prog_.op(v);
    std::vector<ValueId> out;
    std::vector<bool> done(have.size(), false);
    for (std::size_t i = 0; i < have.size(); ++i) {
      if (done[i]) continue;
      std::vector<std::size_t> group;
      const bool reduces = have[i].dims == need[i].dims && have[i].partial.size() > need[i].partial.size();
      for (std::size_t j = i; j < have.size() && reduces; ++j)
        if (!done[j] && have[j] == have[i] && need[j] == need[i]) group.push_back(j);
      if (group.size() < 2) {
        const std::string site = "%" + std::to_string(v) + " add_n operand " + std::to_string(i);
        out.push_back(reshard(op.operands[i], need[i], site));
        continue;
      }
      Op sum{OpKind::add_n, {}, {}, out_.type(local_[static_cast<std::size_t>(op.operands[i])]), ""};
      for (auto j : group) {
        sum.operands.push_back(local_[static_cast<std::size_t>(op.operands[j])]);
        done[j] = true;
      }
      AxisList reduce;
      for (const auto& a : have[i].partial)
        if (!need[i].is_partial(a)) reduce.push_back(a);
      const std::string site = "%" + std::to_string(v) + " add_n " + prog_.label(v) + " (" + std::to_string(group.size()) +
                               " terms partial over the same axes, reduced once)";
      const ValueId local = emit(std::move(sum), have[i]);
      out.push_back(step(local, prog_.type(v), {CollectiveKind::all_reduce, reduce, -1, -1,
                                                reason(op.operands[i], have[i], need[i], site)}, need[i]));
    }
    return out;
  }

  // A convolution whose spatial dims are tiled (sharding/halo.hpp): each tile receives the rows its windows
  // read from the neighbouring tiles, by one collective_permute each way, and the local convolution pads what
  // the received rows do not cover. Tiles smaller than the halo would need rows of farther tiles: refused.
  void exchange_halos(ValueId v, const OpRule& rule, const std::vector<AxisList>& factor_axes, Op& local) {
    const Op& op = prog_.op(v);
    const Shape& xs = prog_.type(op.operands[0]).shape;
    for (std::size_t d = 0; d + 2 < xs.size(); ++d) {
      const auto dim = static_cast<std::int64_t>(d + 1);
      const AxisList& axes = factor_axes[static_cast<std::size_t>(rule.operands[0][d + 1].at(0))];
      if (axes.empty()) continue;
      const ConvSpatialDim s = conv_spatial_dim(op, xs, prog_.type(op.operands[1]).shape, d);
      const HaloExchange h = halo_exchange(s, op.attrs.conv.lhs_dilation[d]);
      ValueId x = local.operands[0];
      const TensorType tile = out_.type(x);
      const Sharding layout = layout_of(x);
      const std::int64_t rows = tile.shape[d + 1];
      std::string origin;
      for (const auto& a : axes) origin += (origin.empty() ? "" : ", ") + axis_origin(op.operands[0], a);
      const std::string where = "convolution " + prog_.label(v) + ": spatial dim " + std::to_string(d) + " of " +
                                prog_.label(op.operands[0]) + " tiled on " + origin;
      auto count_rows = [](std::int64_t n) { return std::to_string(n) + (n == 1 ? " row" : " rows"); };
      if (h.from_previous > rows || h.from_next > rows)
        user_error(where + " into tiles of " + count_rows(rows) + ", but each tile's windows read " +
                   count_rows(std::max(h.from_previous, h.from_next)) + " of a neighbouring tile (a halo exchange "
                   "reaches only the next tile: use fewer tiles on " + to_string(axes) + " or larger inputs)");
      auto rows_of = [&](std::int64_t begin, std::int64_t end) {
        Op slice{OpKind::slice, {x}, {}, tile, ""};
        slice.attrs.lo.assign(tile.shape.size(), 0);
        slice.attrs.hi = tile.shape;
        slice.attrs.lo[d + 1] = begin;
        slice.attrs.hi[d + 1] = end;
        slice.type.shape[d + 1] = end - begin;
        return emit(std::move(slice), layout);
      };
      auto permute = [&](ValueId piece, std::int64_t count, std::int64_t shift) {
        const std::string why = where + ": its windows read " + count_rows(count) + " of the " +
                                (shift > 0 ? "previous" : "next") + " tile (halo exchange)";
        return emit(Op{OpKind::input, {piece}, {}, out_.type(piece), ""}, layout,
                    Collective{CollectiveKind::collective_permute, axes, dim, -1, why, -1, -1, shift});
      };
      std::vector<ValueId> parts;
      if (h.from_previous) parts.push_back(permute(rows_of(rows - h.from_previous, rows), h.from_previous, 1));
      parts.push_back(x);
      if (h.from_next) parts.push_back(permute(rows_of(0, h.from_next), h.from_next, -1));
      if (parts.size() > 1) {
        Op joined{OpKind::concatenate, parts, {}, tile, ""};
        joined.attrs.axis = dim;
        joined.type.shape[d + 1] += h.from_previous + h.from_next;
        x = emit(std::move(joined), layout);
      }
      local.operands[0] = x;
      local.attrs.lo[d] = h.lo;
      local.attrs.hi[d] = h.hi;
    }
  }

  // Pooling on tiles: the rule tiles a windowed dim only where no window leaves its tile, so a tile needs no
  // halo, only the padding that crops what its last window does not read.
  void pad_window_tiles(ValueId v, const OpRule& rule, const std::vector<AxisList>& factor_axes, Op& local) const {
    const Op& op = prog_.op(v);
    const Shape& xs = prog_.type(op.operands[0]).shape;
    const Shape& windows = op.kind == OpKind::select_and_scatter ? prog_.type(op.operands[1]).shape : op.type.shape;
    for (std::size_t d = 0; d < xs.size(); ++d) {
      if (factor_axes[static_cast<std::size_t>(rule.operands[0][d].at(0))].empty()) continue;
      const HaloExchange h = halo_exchange(window_spatial_dim(op, xs, windows, d), op.attrs.window.base_dilation[d]);
      if (h.from_previous || h.from_next) internal_error("lower: pooling %" + std::to_string(v) + " tiled with a halo");
      local.attrs.lo[d] = h.lo;
      local.attrs.hi[d] = h.hi;
    }
  }

  void lower_op(ValueId v) {
    const Op& op = prog_.op(v);
    const TensorType& type = op.type;
    Sharding want = planned(v);
    auto& slot = local_[static_cast<std::size_t>(v)];
    if (op.kind == OpKind::input) {
      want.partial.clear();  // an input is a whole value
      Op local = op;
      local.type.shape = local_shape(type, want, mesh_);
      slot = emit(std::move(local), want);
      out_.add_input({op.name, slot, type, want, ""});
      return;
    }
    if (op.kind == OpKind::constant) {
      want.partial.clear();
      const bool splat = op.attrs.literal.size() == 1;
      Op local = op;
      if (splat) local.type.shape = local.attrs.shape = local_shape(type, want, mesh_);
      slot = emit(std::move(local), splat ? want : Sharding::replicated(type.rank()));
      if (!splat) slot = reshard(v, want, "%" + std::to_string(v) + " constant");
      return;
    }

    const OpRule rule = rule_for(prog_, v, users_[static_cast<std::size_t>(v)]);
    std::vector<AxisList> factor_axes(rule.factors.size());
    Sharding got = Sharding::replicated(type.rank());  // what the local op will compute
    // Result factors present in no operand can be tiled only where each tile is computed alike (a
    // broadcast's new dims) or by row ownership (scatter_add's table rows); elsewhere they stay whole, as do
    // factors that need replication (a plan may tile such a result dim from its users' side).
    auto in_operand = [&](int f) {
      for (std::size_t i = 0; i < rule.operands.size(); ++i)
        if (rule.operand_dim(i, f) >= 0) return true;
      return false;
    };
    AxisList row_shard;
    for (std::size_t d = 0; d < want.dims.size(); ++d) {
      const auto& factors = rule.result[d];
      auto parts = split(want.dims[d], factors, rule);
      if (!parts) continue;
      bool local_ok = true;
      for (std::size_t k = 0; k < factors.size(); ++k) {
        if ((*parts)[k].empty()) continue;
        if (rule.factors[static_cast<std::size_t>(factors[k])].kind == FactorKind::need_replication) local_ok = false;
        if (!in_operand(factors[k]))
          local_ok = local_ok && (op.kind == OpKind::broadcast_in_dim || (op.kind == OpKind::scatter_add && d == 0));
      }
      if (!local_ok) continue;
      for (std::size_t k = 0; k < factors.size(); ++k) factor_axes[static_cast<std::size_t>(factors[k])] = (*parts)[k];
      got.dims[d] = want.dims[d];
      if (op.kind == OpKind::scatter_add && d == 0) row_shard = want.dims[d];
    }
    // An operand dim made of several factors (a dim a reshape merges) is tiled in blocks only if its axes fill
    // the factors major to minor: a minor factor may carry axes only once every more major one is fully
    // tiled. Tiling the minor factor alone would be a strided layout (found by the fuzzer: [4,6,8] reshaped
    // to [4,6,2,4] with the 4 tiled). Such result dims are computed whole; their users reslice them.
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t i = 0; i < rule.operands.size() && !changed; ++i)
        for (const auto& factors : rule.operands[i]) {
          bool open = false;  // a more major factor of this dim is not fully tiled
          for (int f : factors) {
            const auto& axes = factor_axes[static_cast<std::size_t>(f)];
            const auto d = rule.result_dim(f);
            if (open && !axes.empty() && d >= 0) {
              for (int g : rule.result[static_cast<std::size_t>(d)]) factor_axes[static_cast<std::size_t>(g)].clear();
              got.dims[static_cast<std::size_t>(d)].clear();
              if (op.kind == OpKind::scatter_add && d == 0) row_shard.clear();
              changed = true;
              break;
            }
            if (tile_count(axes, mesh_) != rule.factors[static_cast<std::size_t>(f)].size) open = true;
          }
          if (changed) break;
        }
    }

    // Partial sums: carried through a linear op, or made by a tiled reduction factor.
    std::vector<Sharding> have;
    for (auto o : op.operands) have.push_back(layout_of(local_[static_cast<std::size_t>(o)]));
    std::vector<AxisList> operand_partial(op.operands.size());
    for (const auto& p : want.partial) {
      // sum: every linear operand partial over p; product: exactly one, and it linear; the rest clear of p
      std::vector<std::size_t> partial_linear;
      bool others_clear = true;
      std::size_t linear_count = 0;
      for (std::size_t i = 0; i < have.size(); ++i) {
        const bool linear = i < rule.linear.size() && rule.linear[i];
        linear_count += linear;
        // A partial sum with other uses is reduced once at the source instead of in every use.
        if (linear && have[i].is_partial(p) && uses_[static_cast<std::size_t>(op.operands[i])] == 1)
          partial_linear.push_back(i);
        else if (have[i].uses(p)) others_clear = false;
      }
      const bool carried = others_clear && !partial_linear.empty() &&
                           ((rule.partial == PartialRule::sum && partial_linear.size() == linear_count) ||
                            (rule.partial == PartialRule::product && partial_linear.size() == 1)) &&
                           !scaled_after_reduction(v, p, rule, partial_linear);
      if (carried) {
        for (auto i : partial_linear) operand_partial[i].push_back(p);
        got.partial.push_back(p);
        continue;
      }
      for (std::size_t f = 0; f < rule.factors.size(); ++f) {
        if (rule.factors[f].kind != FactorKind::reduction) continue;
        bool tiled = false;
        for (std::size_t i = 0; i < have.size(); ++i) {
          const auto e = rule.operand_dim(i, static_cast<int>(f));
          if (e >= 0) tiled = tiled || std::count(have[i].dims[static_cast<std::size_t>(e)].begin(),
                                                  have[i].dims[static_cast<std::size_t>(e)].end(), p) > 0;
        }
        if (!tiled) continue;
        factor_axes[f].push_back(p);
        got.partial.push_back(p);
        if (op.kind == OpKind::gather) row_shard.push_back(p);
        break;
      }
      if (!got.is_partial(p) && is_elementwise(op.kind)) place_resolved(v, p, rule, got, factor_axes);
    }
    if (is_elementwise(op.kind)) summed_on_tiles(v, rule, have, got, factor_axes);
    if (op.kind == OpKind::reduce_sum) keep_tiled_reduction(v, have[0], got, factor_axes);
    // Operand layouts the factors require; partial axes in mesh order, as Sharding keeps them.
    std::vector<Sharding> needs;
    for (std::size_t i = 0; i < op.operands.size(); ++i) {
      Sharding need = Sharding::replicated(prog_.type(op.operands[i]).rank());
      for (std::size_t e = 0; e < need.dims.size(); ++e)
        for (int f : rule.operands[i][e]) {
          const auto& axes = factor_axes[static_cast<std::size_t>(f)];
          need.dims[e].insert(need.dims[e].end(), axes.begin(), axes.end());
        }
      for (const auto& a : have[i].partial)
        if (std::count(operand_partial[i].begin(), operand_partial[i].end(), a)) need.partial.push_back(a);
      needs.push_back(std::move(need));
    }
    std::vector<ValueId> operands;
    if (op.kind == OpKind::add_n) {
      operands = reduced_in_groups(v, have, needs);
    } else {
      for (std::size_t i = 0; i < op.operands.size(); ++i) {
        const std::string site = "%" + std::to_string(v) + " " + std::string(name_of(op.kind)) + " operand " + std::to_string(i);
        operands.push_back(reshard(op.operands[i], needs[i], site));
      }
    }
    std::sort(got.partial.begin(), got.partial.end(),
              [&](const auto& a, const auto& b) { return mesh_.axis_index(a) < mesh_.axis_index(b); });

    Op local = op;
    local.operands = operands;
    local.type.shape = local_shape(type, got, mesh_);
    if (op.kind == OpKind::broadcast_in_dim || op.kind == OpKind::reshape || op.kind == OpKind::scatter_add)
      local.attrs.shape = local.type.shape;
    if (op.kind == OpKind::slice)  // a tiled dim passes whole (the rule allows it only so): keep all of the tile
      for (std::size_t d = 0; d < local.attrs.hi.size(); ++d)
        if (out_.type(operands[0]).shape[d] != prog_.type(op.operands[0]).shape[d]) local.attrs.hi[d] = out_.type(operands[0]).shape[d];
    if (op.kind == OpKind::convolution) exchange_halos(v, rule, factor_axes, local);
    if (op.kind == OpKind::reduce_window_sum || op.kind == OpKind::reduce_window_max || op.kind == OpKind::select_and_scatter)
      pad_window_tiles(v, rule, factor_axes, local);
    std::vector<TensorType> operand_types;
    for (auto o : local.operands) operand_types.push_back(out_.type(o));
    const TensorType inferred = infer_type(local.kind, operand_types, local.attrs);
    if (inferred != local.type)
      internal_error("lower: local " + std::string(name_of(op.kind)) + " %" + std::to_string(v) + " infers " +
                     to_string(inferred) + " but its layout " + to_string(type, got) + " gives " + to_string(local.type));
    slot = emit(std::move(local), got, std::nullopt, std::move(row_shard));
  }

  const Partitioned& plan_;
  const Program& prog_;
  const Mesh& mesh_;
  SpmdProgram out_;
  std::vector<ValueId> local_;     // global value -> the SPMD value holding its layout as lowered
  std::vector<Sharding> layouts_;  // per SPMD value
  std::map<std::string, ValueId> reshards_;
  std::map<ValueId, ValueId> resolved_;  // value -> where its partial sums were first reduced
  std::vector<int> uses_;  // of each global value
  std::vector<std::vector<ValueId>> users_;
  bool in_backward_pass_ = false;  // of the op being lowered (outputs: as the last op)
  const std::optional<PipelineStages>& pipeline_ = plan_.state().pipeline();
  ValueId current_ = -1;           // the global value being lowered
  int stage_ = -1;                 // its stage
  std::vector<ValueId> source_;    // per SPMD value: the global value whose lowering emitted it
  std::vector<char> recomputed_;   // per global value: remat recomputes it
};

}  // namespace detail

PARTIR_ENTRY SpmdProgram lower(const Partitioned& plan, const LowerOptions& options) {
  SpmdProgram lowered = bucket_collectives(without_dead_ops(detail::Lowering(plan).run()), options.bucket_bytes);
  return options.early_collectives ? schedule_collectives(lowered, options.prefetch_bytes) : lowered;
}
#endif

}  // namespace partir

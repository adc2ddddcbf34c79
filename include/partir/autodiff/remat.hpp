#pragma once
// Activation rematerialization: the backward pass computes some forward values again instead of keeping them
// from the forward pass, trading FLOPs for memory (jax.checkpoint, PyTorch activation checkpointing,
// Megatron's selective recomputation).
//
// A policy is a value, kept apart from the model and from the schedule: the model marks the boundaries of the
// regions a policy may recompute with checkpoint_name() (nn::Gpt marks its embedding, each block's output and
// each attention core's q, k, v and context; nn::Mlp the input and output of its activation function), and a
// Remat names regions by those marks. A region runs from values matching `from` to values matching `to`: the
// values reached forward from a `from` value and backward from a `to` value, without passing another mark, are
// recomputed; marked values, inputs and everything outside every region are kept.
//
// Whatever the policy, Remat::none() included, a value that cheap ops make from inputs and constants alone (a
// scalar's or a bias's broadcast, a parameter's 16-bit cast, the causal mask) is computed again where the
// backward pass or a recomputation reads it, not kept alive from the forward pass for it (XLA rematerializes
// broadcasts alike): it costs an elementwise op or nothing (a fused group reads a broadcast as a pattern), and
// frees what a non-fused reader would have kept (under mixed precision, each weight's 16-bit copy: 2 bytes per
// parameter between its forward and its backward use).
//
// In 16 bits only ops whose value does not depend on the fused group that computes it count as cheap: moves,
// converts (a cast to 16 bits always ends its group, rounded as stored), compare, select, neg, abs, max and min.
// A 16-bit arithmetic step keeps f32 inside its group and is rounded only where stored (kernels/fused_kernel.hpp),
// so computed again inside another group it can differ in its last bit, and a max's gradient, which finds the max
// by equality, would then find none.
//
// rematerialize() rewrites a program with a backward pass (train_step's): each recomputed value is computed
// again just before its first use in the backward pass, from kept values, by the same ops in the same order, so
// results are bitwise those of the program without remat (16-bit regions a policy names: up to the rounding of
// the steps their fused groups do not store). It is a transform on the step rather than a
// tactic because it changes which ops run, where tactics only choose layouts: the partitioner then sees the
// recomputed ops as ops, ties each to its original (they get the same layout), and ZeRO-3 gathers again
// what the recomputation reads.
#include <algorithm>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "partir/config.hpp"
#include "partir/ir/program.hpp"
#include "partir/ir/selector.hpp"

namespace partir {

struct RematRegion {
  std::vector<std::string> from, to;  // globs over checkpoint names
  friend bool operator==(const RematRegion&, const RematRegion&) = default;
};

struct Remat {
  std::string name;  // names the recomputed values' provenance
  std::vector<RematRegion> regions;

  static Remat none() { return {"none", {}}; }
  // Whole transformer blocks (nn::Gpt's marks): only the residual stream between blocks is kept.
  static Remat blocks() { return {"blocks", {{{"**/embed", "**/layers/*/out"}, {"**/layers/*/out"}}}}; }
  // Attention's core alone (Megatron's selective recomputation, Korthikanti et al.): scores, softmax and the
  // weighted sum, recomputed from q, k, v.
  static Remat attention() { return {"attention", {attention_core()}}; }
  // What is cheap to recompute: attention's core and the MLP's activation function (elementwise, from its
  // input, nn::Mlp's a{i} to h{i}); every matmul output is kept.
  static Remat selective() { return {"selective", {attention_core(), {{"**/mlp/a*"}, {"**/mlp/h*"}}}}; }
  // The examples' --remat: none, blocks, selective or attention.
  static Remat parse(const std::string& text, const std::string& source) {
    if (text == "none") return none();
    if (text == "blocks") return blocks();
    if (text == "selective") return selective();
    if (text == "attention") return attention();
    user_error(source + ": unknown remat policy '" + text + "' (expected none, blocks, selective or attention)");
  }
  friend bool operator==(const Remat&, const Remat&) = default;

 private:
  // nn::Attention's marks (…/attn/…) and nn::Llama's (…/self_attn/…).
  static RematRegion attention_core() {
    return {{"**/attn/q|**/self_attn/q", "**/attn/k|**/self_attn/k", "**/attn/v|**/self_attn/v"},
            {"**/attn/context|**/self_attn/context"}};
  }
};

// p with the values `remat` selects, and the cheap ones the backward pass reads, recomputed in the backward pass
// (see above); p itself if there is nothing to recompute.
PARTIR_ENTRY Program rematerialize(const Program& p, const Remat& remat);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

// The marked forward values one region's globs select; a glob that selects none, or selects a value that is
// not a forward value, is a UserError.
inline std::set<ValueId> remat_marks(const Program& p, const Remat& r, const std::vector<std::string>& globs,
                                     const std::vector<char>& forward) {
  std::set<ValueId> out;
  for (const auto& g : globs) {
    bool found = false;
    for (const auto& [v, name] : p.checkpoint_names()) {
      if (!glob_match(g, name)) continue;
      found = true;
      if (!forward[static_cast<std::size_t>(v)])
        user_error("remat '" + r.name + "': '" + name + "' is computed after the loss (by the backward pass or the "
                   "update), so no forward region can end there");
      out.insert(v);
    }
    if (!found)
      user_error("remat '" + r.name + "': '" + g + "' matches no checkpoint name of program '" + p.name() +
                 "' (the model marks region boundaries with checkpoint_name())");
  }
  return out;
}

// Which ops of p belong to a forward pass: those before the backward pass, or with microbatches (segments)
// those of each microbatch's forward segment.
inline std::vector<char> forward_ops(const Program& p, ValueId backward) {
  std::vector<char> out(static_cast<std::size_t>(p.size()), 0);
  if (p.segments().empty()) {
    std::fill(out.begin(), out.begin() + backward, 1);
    return out;
  }
  auto seg = p.segments().begin();
  bool forward = true;
  for (ValueId v = 0; v < p.size(); ++v) {
    for (; seg != p.segments().end() && seg->begin <= v; ++seg) forward = seg->pass == Segment::Pass::forward;
    out[static_cast<std::size_t>(v)] = forward;
  }
  return out;
}

// A 16-bit elementwise op whose value is the same in any fused group (see above).
inline bool rounds_alike(OpKind k) {
  switch (k) {
    case OpKind::convert: case OpKind::compare: case OpKind::select: case OpKind::neg: case OpKind::abs:
    case OpKind::max: case OpKind::min: return true;
    default: return false;
  }
}

// Which forward values of p the policy recomputes.
inline std::vector<bool> recomputed_values(const Program& p, const Remat& r, const std::vector<char>& forward) {
  std::vector<bool> out(static_cast<std::size_t>(p.size()), false);
  std::vector<std::vector<ValueId>> users(static_cast<std::size_t>(p.size()));
  for (ValueId v = 0; v < p.size(); ++v)
    if (forward[static_cast<std::size_t>(v)])
      for (auto o : p.op(v).operands) users[static_cast<std::size_t>(o)].push_back(v);
  for (const auto& region : r.regions) {
    const auto from = remat_marks(p, r, region.from, forward), to = remat_marks(p, r, region.to, forward);
    auto marked = [&](ValueId v) { return from.count(v) || to.count(v); };
    // Reached forward from `from`, then backward from `to`, never through a mark.
    std::vector<char> ahead(static_cast<std::size_t>(p.size()), 0);
    std::vector<ValueId> stack(from.begin(), from.end());
    while (!stack.empty()) {
      const ValueId v = stack.back();
      stack.pop_back();
      for (ValueId u : users[static_cast<std::size_t>(v)])
        if (!marked(u) && !ahead[static_cast<std::size_t>(u)]) ahead[static_cast<std::size_t>(u)] = 1, stack.push_back(u);
    }
    std::vector<char> behind(static_cast<std::size_t>(p.size()), 0);
    stack.assign(to.begin(), to.end());
    while (!stack.empty()) {
      const ValueId v = stack.back();
      stack.pop_back();
      for (ValueId o : p.op(v).operands)
        if (!marked(o) && !behind[static_cast<std::size_t>(o)]) behind[static_cast<std::size_t>(o)] = 1, stack.push_back(o);
    }
    for (ValueId v = 0; v < p.size(); ++v)
      if (forward[static_cast<std::size_t>(v)] && ahead[static_cast<std::size_t>(v)] && behind[static_cast<std::size_t>(v)])
        out[static_cast<std::size_t>(v)] = true;
  }
  return out;
}

}  // namespace detail

PARTIR_ENTRY Program rematerialize(const Program& p, const Remat& remat) {
  const auto backward = p.backward_start();
  if (!backward) {
    if (remat.regions.empty()) return p;
    user_error("remat '" + remat.name + "': program '" + p.name() + "' has no backward pass to recompute in");
  }
  const std::vector<char> forward = detail::forward_ops(p, *backward);
  const std::vector<bool> recomputed = detail::recomputed_values(p, remat, forward);
  if (!remat.regions.empty() && std::none_of(recomputed.begin(), recomputed.end(), [](bool b) { return b; }))
    user_error("remat '" + remat.name + "': its regions of program '" + p.name() + "' hold no value to recompute");
  // Values made from inputs and constants by cheap ops alone (see above).
  std::vector<bool> cheap(static_cast<std::size_t>(p.size()), false);
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!forward[static_cast<std::size_t>(v)]) continue;
    const Op& op = p.op(v);
    const bool moves = op.kind == OpKind::broadcast_in_dim || op.kind == OpKind::reshape || op.kind == OpKind::transpose;
    const bool exact = moves || (is_elementwise(op.kind) && (!is_half(op.type.dtype) || detail::rounds_alike(op.kind)));
    cheap[static_cast<std::size_t>(v)] =
        op.kind == OpKind::constant ||
        (exact && std::all_of(op.operands.begin(), op.operands.end(), [&](ValueId o) {
           return p.op(o).kind == OpKind::input || cheap[static_cast<std::size_t>(o)];
         }));
  }

  auto read_again = [&](ValueId reader, ValueId v) {
    const auto k = static_cast<std::size_t>(v);
    return !forward[static_cast<std::size_t>(reader)] && (recomputed[k] || (cheap[k] && p.op(v).kind != OpKind::constant));
  };
  bool any = false;
  for (ValueId v = *backward; v < p.size() && !any; ++v)
    for (auto o : p.op(v).operands) any |= read_again(v, o);
  if (!any) return p;

  Program out(p.name());
  std::vector<ValueId> copy(static_cast<std::size_t>(p.size()), -1), again(copy);
  // v computed again, from kept values, before its first use in the backward pass (once: later uses share it).
  std::function<ValueId(ValueId)> recompute = [&](ValueId v) -> ValueId {
    auto& slot = again[static_cast<std::size_t>(v)];
    if (slot >= 0) return slot;
    Op op = p.op(v);
    for (auto& o : op.operands) {
      const auto k = static_cast<std::size_t>(o);
      o = recomputed[k] || cheap[k] ? recompute(o) : copy[k];
    }
    const std::string policy = recomputed[static_cast<std::size_t>(v)] ? remat.name : "cheap";
    op.name = "remat(" + policy + ")" + (op.name.empty() ? "" : ":" + op.name);
    slot = out.add_unchecked(std::move(op));
    out.add_recompute({slot, copy[static_cast<std::size_t>(v)], policy});
    return slot;
  };
  auto segment = p.segments().begin();
  for (ValueId v = 0; v < p.size(); ++v) {
    if (v == *backward) out.mark_backward_start(out.size());
    for (; segment != p.segments().end() && segment->begin == v; ++segment)
      out.begin_segment({static_cast<ValueId>(out.size()), segment->microbatch, segment->pass});
    Op op = p.op(v);
    for (auto& o : op.operands) o = read_again(v, o) ? recompute(o) : copy[static_cast<std::size_t>(o)];
    const ValueId at = copy[static_cast<std::size_t>(v)] = out.add_unchecked(std::move(op));
    if (const ValueId of = p.vjp_of(v); of >= 0) out.mark_vjp(at, at + 1, copy[static_cast<std::size_t>(of)]);
  }
  for (const auto& o : p.outputs()) out.add_output(o.name, copy[static_cast<std::size_t>(o.value)], o.updates);
  for (const auto& [v, name] : p.checkpoint_names()) out.checkpoint_name(copy[static_cast<std::size_t>(v)], name);
  for (const auto& r : p.recomputes())
    out.add_recompute({copy[static_cast<std::size_t>(r.value)], copy[static_cast<std::size_t>(r.original)], r.policy});
  return out;
}
#endif

}  // namespace partir

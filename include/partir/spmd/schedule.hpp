#pragma once
// Collectives scheduled for overlap: each moves up to just after what its operand needs, so that the executor's
// communication stream (runtime/comm/comm_stream.hpp) runs it while the ops that used to come first compute: a
// gradient reduction starts as soon as backward has made the gradient (as DDP launches a bucket), a ZeRO-3
// parameter all_gather runs ahead of the layer that uses it (FSDP's prefetch). A collective moves with the local
// ops that only feed it (an optimizer's scaling of a gradient that lowering keeps a partial sum until the
// update). Every device runs the same program, so all still issue their collectives in one order; each op
// computes what it did, so results are bitwise unchanged.
//
// Moving a collective up makes its result live longer. Where that outweighs what the move frees (an all_gather's
// larger result, whose operand is a parameter that stays resident anyway; not a gradient reduction, whose
// gradient lived until the update before), it moves only while the extra bytes at every instruction it passes
// stay within a prefetch budget — by default the largest collective's result, i.e. one ahead. Pipelined
// programs are left as they are: their stages' transfers already leave the sender free.
#include <algorithm>
#include <queue>
#include <string>
#include <vector>

#include "partir/config.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// -1: the budget of one collective ahead (the largest collective result).
inline constexpr std::int64_t one_collective_ahead = -1;

// The program with its collectives moved up within `prefetch_bytes` of extra memory (one_collective_ahead, or
// a byte count >= 0: 0 moves only collectives that cost no memory, such as gradient all_reduces).
PARTIR_ENTRY SpmdProgram schedule_collectives(const SpmdProgram& p, std::int64_t prefetch_bytes = one_collective_ahead);

#if PARTIR_DEFINE_ENTRIES
PARTIR_ENTRY SpmdProgram schedule_collectives(const SpmdProgram& p, std::int64_t prefetch_bytes) {
  if (prefetch_bytes < one_collective_ahead)
    user_error("schedule_collectives: prefetch budget " + std::to_string(prefetch_bytes) +
               " bytes is negative (0 moves only collectives that cost no memory; -1: one collective ahead)");
  if (p.pipeline()) return p;
  const auto n = static_cast<std::size_t>(p.size());
  auto at = [](auto& vec, ValueId v) -> decltype(auto) { return vec[static_cast<std::size_t>(v)]; };
  std::vector<std::vector<ValueId>> users(n);
  std::vector<ValueId> last_use(n, -1);
  for (ValueId v = 0; v < p.size(); ++v)
    for (auto o : p.op(v).op.operands) at(users, o).push_back(v), at(last_use, o) = v;
  std::vector<bool> output(n, false);
  for (const auto& b : p.outputs()) at(output, b.value) = true, at(last_use, b.value) = p.size();

  // Each collective moves with the local ops that only feed it (say an optimizer's scaling of a gradient that is
  // still a partial sum): its group, in program order, the collective last.
  struct Group {
    std::vector<ValueId> members;  // in program order, the collective last
    std::vector<ValueId> outside;  // what the members read from outside the group
    std::vector<ValueId> released;  // outside buffers whose last use is in the group: they die where it moves
  };
  std::vector<bool> grouped(n, false);
  auto group_of = [&](ValueId c) {
    Group g;
    at(grouped, c) = true;
    std::priority_queue<ValueId> candidates;  // latest first: a candidate's users are all decided before it
    candidates.push(p.op(c).op.operands.at(0));
    while (!candidates.empty()) {
      const ValueId u = candidates.top();
      candidates.pop();
      const SpmdOp& s = p.op(u);
      if (at(grouped, u) || s.communicates() || detail::is_program_input(s) || at(output, u) ||
          !std::ranges::all_of(at(users, u), [&](ValueId w) { return at(grouped, w); }))
        continue;
      at(grouped, u) = true;
      g.members.push_back(u);
      for (auto o : s.op.operands) candidates.push(o);
    }
    std::ranges::sort(g.members);
    g.members.push_back(c);
    for (auto m : g.members)
      for (auto o : p.op(m).op.operands)
        if (!at(grouped, o) && std::ranges::find(g.outside, o) == g.outside.end()) g.outside.push_back(o);
    for (auto o : g.outside)
      if (!detail::is_program_input(p.op(o)) && at(last_use, o) < p.size() && at(grouped, at(last_use, o)))
        g.released.push_back(o);
    for (auto m : g.members) at(grouped, m) = false;
    return g;
  };
  // What a group moved up over instruction j adds to the bytes live there: the collective's result, less the
  // group's own values that lived across j where they were, less the outside buffers that now die before j.
  auto cost_at = [&](const Group& g, ValueId j) {
    const ValueId c = g.members.back();
    std::int64_t bytes = p.type(c).bytes();
    for (auto m : g.members)
      if (m != c && m < j && at(last_use, m) > j) bytes -= p.type(m).bytes();
    for (auto o : g.released)
      if (at(last_use, o) > j) bytes -= p.type(o).bytes();
    return bytes;
  };

  std::vector<Group> groups;
  for (ValueId v = 0; v < p.size(); ++v)
    if (p.op(v).communicates()) groups.push_back(group_of(v));
  std::int64_t budget = prefetch_bytes;
  if (budget == one_collective_ahead) {
    budget = 0;
    for (const auto& g : groups) budget = std::max(budget, p.type(g.members.back()).bytes());
  }

  // anchor[v]: the instruction of the original order after which v runs (unmoved ops: themselves).
  std::vector<ValueId> anchor(n);
  for (ValueId v = 0; v < p.size(); ++v) at(anchor, v) = v;
  std::vector<bool> moved(n, false);
  std::vector<std::int64_t> held(n, 0);  // extra bytes of moved collectives live across each instruction
  std::vector<std::vector<ValueId>> after(n);  // moved instructions by anchor, in the order they run
  // Groups move in the order they can start, where the groups before them left what they read (an early
  // gradient's update and all_gather before those of a gradient that backward makes later, though the
  // optimizer updates that one first), so the budget goes first to what overlaps most. A group moves after
  // the groups whose collectives it reads: those are in place before it is placed.
  std::vector<int> group_at(n, -1);
  for (std::size_t i = 0; i < groups.size(); ++i)
    for (auto m : groups[i].members) at(group_at, m) = static_cast<int>(i);
  std::vector<bool> placed(groups.size(), false);
  auto earliest_of = [&](const Group& g) {  // where what it reads from outside runs now
    ValueId earliest = 0;
    for (auto o : g.outside) earliest = std::max(earliest, at(anchor, o));
    return earliest;
  };
  auto can_place = [&](const Group& g) {
    return std::ranges::all_of(g.outside, [&](ValueId o) {
      return at(group_at, o) < 0 || placed[static_cast<std::size_t>(at(group_at, o))];
    });
  };
  for (std::size_t round = 0; round < groups.size(); ++round) {
    std::size_t next = groups.size();
    ValueId earliest = 0;  // where the next group can go at the soonest (after the first op)
    for (std::size_t i = 0; i < groups.size(); ++i) {
      if (placed[i] || !can_place(groups[i])) continue;
      const ValueId e = earliest_of(groups[i]);
      if (next == groups.size() || e < earliest) next = i, earliest = e;
    }
    placed[next] = true;
    const Group& g = groups[next];
    const ValueId c = g.members.back();
    ValueId a = c - 1;  // unmoved: after the instruction before it
    while (a > earliest && at(held, a) + cost_at(g, a) <= budget) --a;
    for (ValueId j = a + 1; j < c; ++j) at(held, j) += cost_at(g, j);
    for (auto m : g.members) {
      if (m <= a) continue;  // already runs before the collective's new place
      at(anchor, m) = a;
      at(moved, m) = true;
      at(after, a).push_back(m);
    }
  }
  std::vector<ValueId> order;
  order.reserve(n);
  for (ValueId v = 0; v < p.size(); ++v) {
    if (!at(moved, v)) order.push_back(v);
    order.insert(order.end(), at(after, v).begin(), at(after, v).end());
  }
  return reordered(p, order);
}
#endif

}  // namespace partir

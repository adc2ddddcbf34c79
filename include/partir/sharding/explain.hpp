#pragma once
// Rendering a plan for people: the program with each value's sharding (stable golden text, one line per op)
// and explain(), the chain of reasons behind every axis on a value.
#include <ostream>

#include "partir/config.hpp"
#include "partir/ir/printer.hpp"
#include "partir/sharding/partitioned.hpp"

namespace partir {

namespace detail {

inline std::string plan_text(const Partitioned& p, const std::vector<Sharding>& shardings,
                             const std::vector<Conflict>& conflicts, const std::vector<Stop>& stops,
                             const std::string& after) {
  const Program& prog = p.program();
  std::string s = "program " + prog.name() + " on " + p.mesh().to_string() + after + " {\n";
  for (ValueId v = 0; v < prog.size(); ++v) {
    const std::string line = to_string(prog, v);  // "... : f32[16,4]": swap the type for the sharded type
    const auto type = to_string(prog.type(v));
    s += "  " + line.substr(0, line.size() - type.size()) +
         to_string(prog.type(v), shardings[static_cast<std::size_t>(v)]) + "\n";
  }
  for (const auto& o : prog.outputs()) {
    s += "  output \"" + o.name + "\" = %" + std::to_string(o.value);
    if (!o.updates.empty()) s += " updates \"" + o.updates + "\"";
    s += "\n";
  }
  for (const auto& c : conflicts) s += "  conflict: " + c.message + "\n";
  for (const auto& t : stops) s += "  stop: " + t.message + "\n";
  return s + "}\n";
}

inline std::string placement(std::int64_t dim) {
  return dim >= 0 ? "dim " + std::to_string(dim) : dim == partial_dim ? "partial sum" : "replicated";
}

}  // namespace detail

// The plan after all tactics.
inline std::string to_string(const Partitioned& p) {
  return detail::plan_text(p, p.shardings(), p.conflicts(), p.stops(), "");
}
// The plan right after tactic `index` (0-based) of the schedule.
inline std::string to_string(const Partitioned& p, std::size_t index) {
  const auto& h = p.history().at(index);
  return detail::plan_text(p, h.shardings, h.conflicts, h.stops,
                           " after " + p.state().tactic_label(static_cast<int>(index)));
}
inline std::ostream& operator<<(std::ostream& os, const Partitioned& p) { return os << to_string(p); }

// For each axis on the value, the chain back to the tactic that put it there:
//   %9 "params/mlp/h1" : f32[16{batch},8{model}]
//     params/mlp/h1 dim 1 on 'model': from %6 dim 1 through %9 max
//       %6 dim 1 on 'model': from %3 dim 1 through %6 add
//       %3 dim 1 on 'model': from params/mlp/w1 dim 1 through %3 dot_general
//       params/mlp/w1 dim 1 on 'model': set by tactic 2 (megatron)
// then the conflicts and stops that involve the value.
PARTIR_ENTRY std::string explain(const Partitioned& p, ValueId v);
inline std::string explain(const Partitioned& p, std::string_view name) { return explain(p, p.value(name)); }

#if PARTIR_DEFINE_ENTRIES
PARTIR_ENTRY std::string explain(const Partitioned& p, ValueId v) {
  const Program& prog = p.program();
  const auto& state = p.state();
  std::string s = "%" + std::to_string(v) + (prog.op(v).name.empty() ? "" : " \"" + prog.op(v).name + "\"") +
                  " : " + p.typed(v) + "\n";
  for (const auto& first : p.provenance(v)) {
    const std::string axis = "'" + p.mesh().axes()[static_cast<std::size_t>(first.axis)].name + "'";
    const Provenance* step = &first;
    ValueId at = v;
    for (std::string indent = "  "; step; indent = "    ") {
      s += indent + prog.label(at) + " " + detail::placement(step->dim) + (step->dim == partial_dim ? " over " : " on ") +
           axis + ": ";
      if (step->via == Provenance::Via::seed) {
        s += "set by " + state.tactic_label(step->tactic) + "\n";
        break;
      }
      s += "from " + prog.label(step->from) + " " + detail::placement(step->from_dim) + " through " +
           state.site(step->via, step->site) + "\n";
      at = step->from;
      const Provenance* next = nullptr;
      for (const auto& q : p.provenance(at))
        if (q.axis == first.axis) next = &q;
      step = next;
    }
  }
  if (const auto& pp = state.pipeline()) {
    const int stage = pp->stage[static_cast<std::size_t>(v)], chunk = pp->chunk[static_cast<std::size_t>(v)];
    s += "  " + prog.label(v) + (stage >= 0 ? " on stage " + std::to_string(stage) : " on every stage that reads it") +
         " of '" + pp->axis + "': " + pp->tactic_label;
    if (chunk >= 0 && static_cast<std::size_t>(chunk) < pp->cut.size())
      s += " (" + (pp->schedule.chunks > 1 ? "virtual stage " + std::to_string(chunk) + ": " : std::string()) +
           pp->cut[static_cast<std::size_t>(chunk)] + ")";
    s += "\n";
  }
  const std::string op_site = state.site(Provenance::Via::op, v);
  for (const auto& c : p.conflicts())
    if (c.wanted.value == v || c.existing.value == v || c.site == op_site) s += "  conflict: " + c.message + "\n";
  for (const auto& t : p.stops())
    if (t.from.value == v || t.site == op_site) s += "  stop: " + t.message + "\n";
  return s;
}
#endif

}  // namespace partir

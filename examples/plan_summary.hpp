#pragma once
// What a newcomer should see of a plan before it runs, compactly: the mesh and schedule, one line per tactic
// (how many values each mesh axis tiles after it, and the conflicts so far), a picture of one weight's tiles,
// why each of its axes is there, and the collectives one step runs.
#include <partir/partir.hpp>

#include <map>
#include <ostream>
#include <string>

namespace examples {

namespace p = partir;

inline void print_plan_summary(std::ostream& os, const p::Partitioned& plan, const p::SpmdProgram& spmd,
                               const std::string& schedule, const std::string& weight) {
  const p::Mesh& mesh = plan.mesh();
  os << "mesh " << mesh.to_string() << " (" << mesh.num_devices() << " devices), schedule " << schedule << "\n";
  const auto values = plan.program().size();
  os << "plan after each tactic (values tiled or partial on each axis, of " << values << "):\n";
  for (std::size_t t = 0; t < plan.history().size(); ++t) {
    const p::Snapshot& s = plan.history()[t];
    os << "  " << plan.state().tactic_label(static_cast<int>(t)) << ":";
    for (const auto& axis : mesh.axes()) {
      int on_axis = 0;
      for (const auto& sh : s.shardings) on_axis += sh.dim_of(axis.name) >= 0 || sh.is_partial(axis.name);
      os << " " << axis.name << " " << on_axis;
    }
    os << "; conflicts " << s.conflicts.size() << ", stops " << s.stops.size() << "\n";
  }
  if (plan.history().empty()) os << "  (no tactics: every value is replicated)\n";
  os << p::visualize(plan, weight) << p::explain(plan, weight);
  std::map<std::string, std::pair<int, std::int64_t>> per_kind;  // count, bytes per device
  for (const auto& c : spmd.collectives()) {
    auto& [count, bytes] = per_kind[std::string(p::name_of(c.collective.kind))];
    ++count;
    bytes += c.bytes;
  }
  os << "collectives per step:";
  if (per_kind.empty()) os << " none";
  for (const auto& [kind, cb] : per_kind)
    os << " " << cb.first << " " << kind << " (" << p::human_bytes(static_cast<double>(cb.second)) << ")";
  os << " per device; `--report json` lists each with its reason\n";
}

}  // namespace examples

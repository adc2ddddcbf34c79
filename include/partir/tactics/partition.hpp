#pragma once
// partition(program, mesh, schedule): applies the tactics in order, propagating after each, and returns the
// plan with one snapshot per tactic.
#include "partir/sharding/partitioned.hpp"
#include "partir/tactics/tactic.hpp"

namespace partir {

PARTIR_ENTRY Partitioned partition(const Program& program, const Mesh& mesh, const Schedule& schedule);

#if PARTIR_DEFINE_ENTRIES
PARTIR_ENTRY Partitioned partition(const Program& program, const Mesh& mesh, const Schedule& schedule) {
  PartitionState state(program, mesh);
  std::vector<Snapshot> history;
  for (const auto& tactic : schedule) {
    state.begin_tactic(tactic.name());
    tactic.apply(state);
    state.propagate();
    history.push_back(Snapshot::of(state, tactic.name()));
  }
  return {std::move(state), std::move(history)};
}
#endif

}  // namespace partir

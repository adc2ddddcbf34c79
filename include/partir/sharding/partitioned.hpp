#pragma once
// Partitioned: what partition() returns. The program, the mesh, a Sharding per value, the conflicts and
// stops met on the way, the provenance of every axis, and history(): one Snapshot per tactic, so a user can
// print or compare the plan after each step of the schedule.
#include "partir/sharding/propagate.hpp"

namespace partir {

// The plan right after one tactic (and its propagation); conflicts and stops are cumulative.
struct Snapshot {
  std::string tactic;
  std::vector<Sharding> shardings;
  std::vector<Conflict> conflicts;
  std::vector<Stop> stops;

  static Snapshot of(const PartitionState& s, std::string tactic) {
    return {std::move(tactic), s.shardings(), s.conflicts(), s.stops()};
  }
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

class Partitioned {
 public:
  Partitioned(PartitionState state, std::vector<Snapshot> history)
      : state_(std::move(state)), history_(std::move(history)), shardings_(state_.shardings()) {}

  const Program& program() const { return state_.program(); }
  const Mesh& mesh() const { return state_.mesh(); }
  const std::vector<Sharding>& shardings() const { return shardings_; }
  const Sharding& sharding(ValueId v) const { return shardings_.at(static_cast<std::size_t>(v)); }
  // By input name or tag, else by output name (an output updating an input shares its name: the input wins,
  // and the two have one sharding when propagation could tie them).
  const Sharding& sharding(std::string_view name) const { return sharding(value(name)); }
  ValueId value(std::string_view name) const {
    for (ValueId v = 0; v < program().size(); ++v)
      if (program().op(v).name == name) return v;
    if (auto v = program().find_output(std::string(name))) return *v;
    user_error("partitioned program '" + program().name() + "' has no input, tag or output named '" +
               std::string(name) + "'");
  }
  // "f32[256{batch},1024{model}] sum{model}"
  std::string typed(ValueId v) const { return to_string(program().type(v), sharding(v)); }

  const std::vector<Conflict>& conflicts() const { return state_.conflicts(); }
  const std::vector<Stop>& stops() const { return state_.stops(); }
  const std::vector<Provenance>& provenance(ValueId v) const { return state_.provenance(v); }
  const std::vector<Snapshot>& history() const { return history_; }
  const std::vector<std::string>& tactics() const { return state_.tactics(); }
  // The full state, for tactics that continue from this plan and for lowering's questions about rules.
  const PartitionState& state() const { return state_; }

  friend bool operator==(const Partitioned& a, const Partitioned& b) {
    return a.program() == b.program() && a.mesh() == b.mesh() && a.history_ == b.history_ &&
           a.shardings_ == b.shardings_ && a.conflicts() == b.conflicts() && a.stops() == b.stops() &&
           a.state().pipeline() == b.state().pipeline();
  }

 private:
  PartitionState state_;
  std::vector<Snapshot> history_;
  std::vector<Sharding> shardings_;
};

}  // namespace partir

#pragma once
// Why each axis sits where it does, as data: the origin of every axis on every value, the conflicts where
// two decisions met, and the stops where an op's rule would not carry an axis further. explain() renders it.
#include <cstdint>
#include <string>

#include "partir/ir/op.hpp"

namespace partir {

// Where an axis is on a value: a tiled dim (>= 0), or one of these.
inline constexpr std::int64_t partial_dim = -1;     // the value is a partial sum over the axis
inline constexpr std::int64_t replicated_dim = -2;  // a Replicate tactic keeps the axis off the value

// How one axis came to be on one value.
struct Provenance {
  enum class Via : std::uint8_t { seed, op, tie, remat };
  int axis = -1;                 // mesh axis index
  std::int64_t dim = partial_dim;
  int tactic = -1;               // schedule index of the tactic whose step placed it
  Via via = Via::seed;           // seed: set by the tactic itself
  std::int32_t site = -1;        // op: the op whose rule carried it; tie: the output tying value and input
  ValueId from = -1;             // op, tie: the neighbour it came from
  std::int64_t from_dim = partial_dim;  // the neighbour's placement of the axis
  friend bool operator==(const Provenance&, const Provenance&) = default;
};

// One side of a conflict: a decision about an axis on a value and the tactic it goes back to.
struct Origin {
  int tactic = -1;
  ValueId value = -1;
  std::int64_t dim = partial_dim;  // as in Provenance
  friend bool operator==(const Origin&, const Origin&) = default;
};

// Two decisions that cannot both hold. The earlier tactic's decision stays; the wanted one is not carried
// past `site` (the op, or tie, is left unsharded on the axis there).
struct Conflict {
  int tactic = -1;   // the tactic being applied when the conflict was found
  std::string axis;
  std::string site;  // "%3 dot_general", "output 'w' updates input 'w'", or the seed's value
  Origin wanted;     // the decision that could not be carried further
  Origin existing;   // the decision in its way
  std::string message;
  friend bool operator==(const Conflict&, const Conflict&) = default;
};

// An op's rule does not let an axis through (a need-replication factor, a reshape needing a sub-axis, a
// factor too small for the axis). Lowering gathers there; nothing is wrong with the schedule.
struct Stop {
  int tactic = -1;
  std::string axis;
  std::string site;
  Origin from;  // the tiling that stopped
  std::string reason;
  std::string message;
  friend bool operator==(const Stop&, const Stop&) = default;
};

}  // namespace partir

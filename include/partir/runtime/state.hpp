#pragma once
// Loop-carried training state: the outputs of a step that update inputs become those inputs next step.
#include "partir/ir/program.hpp"
#include "partir/runtime/array.hpp"

namespace partir {

// Moves every output with Output::updates into state under the input's name; returns the other outputs.
inline NamedArrays carry_state(const Program& p, NamedArrays& state, NamedArrays outputs) {
  for (const auto& o : p.outputs()) {
    if (o.updates.empty()) continue;
    auto it = outputs.find(o.name);
    if (it == outputs.end()) user_error("carry_state: output '" + o.name + "' is missing");
    state[o.updates] = std::move(it->second);
    outputs.erase(it);
  }
  return outputs;
}

}  // namespace partir

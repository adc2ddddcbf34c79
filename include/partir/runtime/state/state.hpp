#pragma once
// Loop-carried training state: the outputs of a step that update inputs become those inputs next step.
#include "partir/ir/program.hpp"
#include "partir/runtime/kernels/array.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// The inputs a training loop carries and a checkpoint holds: parameters and optimizer state (data inputs
// come from the data pipeline, step by step).
inline bool is_state(const SpmdProgram& p, const Binding& b) {
  const auto kind = p.op(b.value).op.attrs.input_kind;
  return kind == InputKind::parameter || kind == InputKind::optimizer_state;
}

// State the device holds: all of it, or in a pipelined program its own stage's.
inline bool holds_state(const SpmdProgram& p, const Binding& b, std::int64_t device) {
  return is_state(p, b) && p.runs(b.value, p.stage_of(device));
}

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

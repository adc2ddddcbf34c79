#pragma once
// Runs a whole Program on this host, one kernel per op or per fused group of elementwise ops (fusion.hpp),
// freeing every intermediate after its last use (into the thread's buffer cache, for the next ops and runs).
#include <optional>
#include <string>
#include <vector>

#include "partir/ir/program.hpp"
#include "partir/runtime/kernels/buffer_cache.hpp"
#include "partir/runtime/kernels/malloc_policy.hpp"
#include "partir/runtime/exec/run_op.hpp"

namespace partir {

struct RunStats {
  // Peak of the bytes resident at once, counted as: every input for the whole run (the caller owns them);
  // an intermediate from its op until the op that uses it last (so an op's operands and its result count
  // together; a value nobody uses counts during its own op only); an output until the end. Copies made to
  // return an input or the same value under two output names are the caller's result and not counted.
  std::int64_t peak_bytes = 0;
};

// Returns the program's outputs by name. `inputs` (NamedArrays, or another map from name to Array) must
// hold exactly the program's inputs, with their types; they are read in place, never copied.
template <class Inputs = NamedArrays>
NamedArrays interpret(const Program& p, const Inputs& inputs, RunStats* stats = nullptr) {
  keep_freed_memory();  // as the backends do: a step must not page-fault its buffers afresh
  const std::string where = "interpret " + p.name();
  std::int64_t resident = 0;
  for (auto v : p.inputs()) {
    const Op& op = p.op(v);
    auto it = inputs.find(op.name);
    if (it == inputs.end()) user_error(where + ": missing input '" + op.name + "'");
    if (it->second.type() != op.type)
      user_error(where + ": input '" + op.name + "' expects " + to_string(op.type) + ", got " +
                 to_string(it->second.type()));
    resident += op.type.bytes();
  }
  for (const auto& [name, array] : inputs)
    if (!p.find_input(name)) user_error(where + ": no input named '" + name + "'");

  const auto n = static_cast<std::size_t>(p.size());
  std::vector<const Array*> values(n, nullptr);
  std::vector<std::optional<Array>> owned(n);  // intermediates and outputs; inputs stay the caller's
  const FusionPlan fusion = plan_fusion(p);
  const auto& frees = fusion.last_uses();
  std::int64_t peak = resident;
  for (ValueId v = 0; v < p.size(); ++v) {
    const Op& op = p.op(v);
    if (op.kind == OpKind::input) {
      values[v] = &inputs.find(op.name)->second;
    } else if (fusion.runs_at(v)) {
      try {
        owned[v] = run_op(op, fusion.group_at(v), values, owned, frees[v]);
      } catch (const UserError& e) {
        user_error(where + ": " + p.label(v) + ": " + e.what());
      }
      values[v] = &*owned[v];
      resident += owned[v]->bytes() + bind_side_outputs(fusion.group_at(v), values, owned);
      peak = std::max(peak, resident);
    }
    for (auto dead : frees[v]) {
      if (!owned[dead]) continue;
      resident -= owned[dead]->bytes();
      kernels::buffer_cache().give(std::move(*owned[dead]));
      owned[dead].reset();
      values[dead] = nullptr;
    }
  }
  kernels::buffer_cache().end_run();
  if (stats) stats->peak_bytes = peak;

  // The last output naming an intermediate takes its buffer; inputs and earlier names get copies.
  std::vector<std::size_t> last_output(n, 0);
  for (std::size_t i = 0; i < p.outputs().size(); ++i) last_output[p.outputs()[i].value] = i;
  NamedArrays result;
  for (std::size_t i = 0; i < p.outputs().size(); ++i) {
    const auto& o = p.outputs()[i];
    if (owned[o.value] && last_output[o.value] == i) result.emplace(o.name, std::move(*owned[o.value]));
    else result.emplace(o.name, *values[o.value]);
  }
  return result;
}

}  // namespace partir

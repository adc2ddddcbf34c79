#pragma once
// One step of a runner (interpreter or executor): computes a value from the values computed so far, as a
// fused group when the plan roots one there, else by the op's own kernel. A reshape whose operand dies at
// it takes the operand's buffer instead of copying it (row-major: same elements, same order), and so does a
// group from an input that dies there (fused_in_place).
#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include "partir/runtime/kernels/eval.hpp"

namespace partir {

// `from`'s storage as an array of `shape` (the same element count), leaving `from` an empty husk.
inline Array take_storage(Array& from, const Shape& shape) {
  return std::visit([&](auto& data) { return Array(shape, std::move(data)); }, from.storage());
}

// values[v]: v's array while it is live; owned[v]: the runner's own buffers (a reshape may move one out:
// the runner then frees an empty husk, which the buffer cache ignores); dying: the values whose last use
// this op is.
inline Array run_op(const Op& op, const FusionGroup* group, std::span<const Array* const> values,
                    std::span<std::optional<Array>> owned, std::span<const ValueId> dying) {
  auto takeable = [&](ValueId v) {
    return owned[static_cast<std::size_t>(v)] && std::find(dying.begin(), dying.end(), v) != dying.end();
  };
  auto take = [&](ValueId v) { return take_storage(*owned[static_cast<std::size_t>(v)], op.type.shape); };
  std::vector<const Array*> operands;
  if (group) {
    for (const auto& in : group->inputs) operands.push_back(values[static_cast<std::size_t>(in.value)]);
    // A dying input read element for element, of the result's type (Adam's m, v or a donated parameter),
    // takes the result: each element is read before it is written, and the write finds its line in cache.
    for (const auto& in : group->inputs) {
      const ValueId v = in.value;
      if (!takeable(v) || values[static_cast<std::size_t>(v)]->type() != group->type ||
          !fused_in_place(*group, v))
        continue;
      Array out = take(v);
      for (std::size_t k = 0; k < operands.size(); ++k)
        if (group->inputs[k].value == v) operands[k] = &out;
      eval_fused_into(*group, operands, out);
      return out;
    }
    return eval_fused(*group, operands);
  }
  if (op.kind == OpKind::reshape && takeable(op.operands[0])) return take(op.operands[0]);
  for (auto o : op.operands) operands.push_back(values[static_cast<std::size_t>(o)]);
  return eval(op, operands);
}

}  // namespace partir

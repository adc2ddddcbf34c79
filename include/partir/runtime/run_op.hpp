#pragma once
// One step of a runner (interpreter or executor): computes a value from the values computed so far, as a
// fused group when the plan roots one there, else by the op's own kernel. A reshape whose operand dies at
// it takes the operand's buffer instead of copying it (row-major: same elements, same order).
#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include "partir/runtime/kernels/eval.hpp"

namespace partir {

// values[v]: v's array while it is live; owned[v]: the runner's own buffers (a reshape may move one out:
// the runner then frees an empty husk, which the buffer cache ignores); dying: the values whose last use
// this op is.
inline Array run_op(const Op& op, const FusionGroup* group, std::span<const Array* const> values,
                    std::span<std::optional<Array>> owned, std::span<const ValueId> dying) {
  std::vector<const Array*> operands;
  if (group) {
    for (const auto& in : group->inputs) operands.push_back(values[static_cast<std::size_t>(in.value)]);
    return eval_fused(*group, operands);
  }
  if (op.kind == OpKind::reshape) {
    const ValueId from = op.operands[0];
    auto& buffer = owned[static_cast<std::size_t>(from)];
    if (buffer && std::find(dying.begin(), dying.end(), from) != dying.end())
      return std::visit([&](auto& v) { return Array(op.type.shape, std::move(v)); }, buffer->storage());
  }
  for (auto o : op.operands) operands.push_back(values[static_cast<std::size_t>(o)]);
  return eval(op, operands);
}

}  // namespace partir

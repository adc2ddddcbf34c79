#pragma once
// One step of a runner (interpreter or executor): computes a value from the values computed so far, as a
// fused group when the plan roots one there, else by the op's own kernel. A reshape whose operand dies at
// it takes the operand's buffer instead of copying it (row-major: same elements, same order), and so does a
// group from an input that dies there (fused_in_place).
#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include "partir/runtime/kernels/buffer_cache.hpp"
#include "partir/runtime/kernels/eval.hpp"

namespace partir {

// `from`'s storage as an array of `shape` (the same element count), leaving `from` an empty husk.
inline Array take_storage(Array& from, const Shape& shape) {
  return std::visit([&](auto& data) { return Array(shape, std::move(data)); }, from.storage());
}

// values[v]: v's array while it is live; owned[v]: the runner's own buffers (a reshape may move one out:
// the runner then frees an empty husk, which the buffer cache ignores); dying: the values whose last use
// this op is. A group's side outputs are left in owned[] for the runner to bind.
inline Array run_op(const Op& op, const FusionGroup* group, std::span<const Array* const> values,
                    std::span<std::optional<Array>> owned, std::span<const ValueId> dying) {
  auto takeable = [&](ValueId v) {
    return owned[static_cast<std::size_t>(v)] && std::find(dying.begin(), dying.end(), v) != dying.end();
  };
  auto take = [&](ValueId v) { return take_storage(*owned[static_cast<std::size_t>(v)], op.type.shape); };
  std::vector<const Array*> operands;
  if (group) {
    for (const auto& in : group->inputs) operands.push_back(values[static_cast<std::size_t>(in.value)]);
    // Each value the group stores takes a dying input read element for element, of the group's type (Adam's m,
    // v or a donated parameter), if one is left: each element is read before it is written, and the write finds
    // its line in cache.
    auto buffer = [&](Array& home) {
      for (std::size_t k = 0; k < operands.size(); ++k) {
        const ValueId v = group->inputs[k].value;
        if (operands[k] != values[static_cast<std::size_t>(v)] || !takeable(v) || operands[k]->type() != group->type ||
            !fused_in_place(*group, v))
          continue;  // (an input already taken points at its new home)
        home = take(v);
        for (std::size_t j = k; j < operands.size(); ++j)
          if (group->inputs[j].value == v) operands[j] = &home;
        return;
      }
      home = kernels::buffer_cache().take(group->type);
    };
    Array out;
    buffer(out);
    std::vector<Array*> sides;
    for (int k : group->side_outputs) {
      auto& side = owned[static_cast<std::size_t>(group->steps[static_cast<std::size_t>(k)].value)];
      buffer(side.emplace());
      sides.push_back(&*side);
    }
    eval_fused_into(*group, operands, out, sides);
    return out;
  }
  if (op.kind == OpKind::reshape && takeable(op.operands[0])) return take(op.operands[0]);
  for (auto o : op.operands) operands.push_back(values[static_cast<std::size_t>(o)]);
  return eval(op, operands);
}

// Points values[] at the side outputs run_op left in owned[] for `group` (if any); returns their bytes.
inline std::int64_t bind_side_outputs(const FusionGroup* group, std::span<const Array*> values,
                                      std::span<std::optional<Array>> owned) {
  std::int64_t bytes = 0;
  if (group)
    for (int k : group->side_outputs) {
      const auto v = static_cast<std::size_t>(group->steps[static_cast<std::size_t>(k)].value);
      values[v] = &*owned[v];
      bytes += owned[v]->bytes();
    }
  return bytes;
}

}  // namespace partir

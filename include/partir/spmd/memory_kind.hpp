#pragma once
// MemoryKind: what a resident buffer holds, per value of an SpmdProgram. Part of the ExecutionPlan, so the
// simulator's memory breakdown and the runtime's accounting name buffers alike.
#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "partir/spmd/spmd_program.hpp"

namespace partir {

// What a resident buffer holds. Inputs by their InputKind; an output that updates an input takes that
// input's kind (new parameters, new optimizer state); a parameter's cast to another dtype (a mixed-precision
// policy's 16-bit copy of its master weights) is a parameter copy; a collective's result is a collective
// buffer; other intermediates are activations when some plain output (the loss) depends on them, else
// gradients (the backward pass and the optimizer's arithmetic).
enum class MemoryKind : std::uint8_t {
  parameters, parameter_copies, optimizer_state, data, activations, gradients, collective_buffers, count_
};

inline std::string_view name_of(MemoryKind k) {
  static constexpr std::array<std::string_view, 7> names{"parameters", "parameter_copies", "optimizer_state", "data",
                                                         "activations", "gradients", "collective_buffers"};
  return names[static_cast<std::size_t>(k)];
}

// The MemoryKind of every value (see MemoryKind).
inline std::vector<MemoryKind> memory_kinds(const SpmdProgram& p) {
  const auto n = static_cast<std::size_t>(p.size());
  auto kind_of_input = [](InputKind k) {
    switch (k) {
      case InputKind::parameter: return MemoryKind::parameters;
      case InputKind::optimizer_state: return MemoryKind::optimizer_state;
      case InputKind::data: return MemoryKind::data;
    }
    return MemoryKind::data;
  };
  std::vector<MemoryKind> kinds(n, MemoryKind::gradients);
  // Values some plain output depends on: the forward pass.
  std::vector<bool> forward(n, false);
  for (const auto& o : p.outputs())
    if (o.updates.empty()) forward[static_cast<std::size_t>(o.value)] = true;
  for (auto v = n; v-- > 0;)
    if (forward[v])
      for (auto operand : p.op(static_cast<ValueId>(v)).op.operands) forward[static_cast<std::size_t>(operand)] = true;
  for (std::size_t v = 0; v < n; ++v) {
    const SpmdOp& s = p.op(static_cast<ValueId>(v));
    if (detail::is_program_input(s)) kinds[v] = kind_of_input(s.op.attrs.input_kind);
    else if (s.collective) kinds[v] = MemoryKind::collective_buffers;
    else if (s.op.kind == OpKind::convert && kinds[static_cast<std::size_t>(s.op.operands[0])] == MemoryKind::parameters)
      kinds[v] = MemoryKind::parameter_copies;
    else if (forward[v]) kinds[v] = MemoryKind::activations;
  }
  for (const auto& o : p.outputs()) {
    if (o.updates.empty() || detail::is_program_input(p.op(o.value))) continue;
    for (const auto& in : p.inputs())
      if (in.name == o.updates) kinds[static_cast<std::size_t>(o.value)] = kinds[static_cast<std::size_t>(in.value)];
  }
  return kinds;
}


}  // namespace partir

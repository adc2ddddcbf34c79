#pragma once
// The kernels' entry points: one op, or one fused group, computed from its operands' values. Their
// definitions (kernels.hpp, fused_kernel.hpp: Eigen, oneDNN, most of a translation unit's compile time)
// follow header-only, and come from libpartir with PARTIR_SEPARATE_COMPILATION (config.hpp).
#include <algorithm>
#include <span>

#include "partir/config.hpp"
#include "partir/ir/op.hpp"
#include "partir/runtime/kernels/array.hpp"
#include "partir/spmd/fusion.hpp"

namespace partir {

// Computes one op from its operand values. Inputs have no kernel: whoever runs the program binds them.
// Float to i32 conversion truncates toward zero.
PARTIR_ENTRY Array eval(const Op& op, std::span<const Array* const> operands);

// The result of a group without side outputs from its inputs' values (one per FusionGroup::inputs entry, in
// order).
PARTIR_ENTRY Array eval_fused(const FusionGroup& g, std::span<const Array* const> inputs);
// The group's result written into `out`, a buffer of the group's type, and each side output into its buffer
// (in FusionGroup::side_outputs order); any of them may be an input v's own where fused_in_place(g, v).
PARTIR_ENTRY void eval_fused_into(const FusionGroup& g, std::span<const Array* const> inputs, Array& out,
                                  std::span<Array* const> side_outputs);

// Whether the group may write its result over input v: every read of v is element for element (each element
// read before it is written), and the result is whole blocks of the kernel's widest (16 elements), since a
// short last tile is recomputed over the end of the one before it, which would read results as inputs.
inline bool fused_in_place(const FusionGroup& g, ValueId v) {
  constexpr std::int64_t widest_block = 16;
  const std::int64_t n = g.type.elements();
  return n >= widest_block && n % widest_block == 0 &&
         std::ranges::all_of(g.inputs, [&](const FusedInput& in) { return in.value != v || in.mod == 0; });
}

}  // namespace partir

#if PARTIR_DEFINE_ENTRIES
#include "partir/runtime/kernels/kernels.hpp"  // and fused_kernel.hpp, at its end
#endif

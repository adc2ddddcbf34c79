#pragma once
// The kernels' entry points: one op, or one fused group, computed from its operands' values. Their
// definitions (kernels.hpp, fused_kernel.hpp: Eigen, oneDNN, most of a translation unit's compile time)
// follow header-only, and come from libpartir with PARTIR_SEPARATE_COMPILATION (config.hpp).
#include <span>

#include "partir/config.hpp"
#include "partir/ir/op.hpp"
#include "partir/runtime/kernels/array.hpp"
#include "partir/runtime/kernels/fusion.hpp"

namespace partir {

// Computes one op from its operand values. Inputs have no kernel: whoever runs the program binds them.
// Float to i32 conversion truncates toward zero.
PARTIR_ENTRY Array eval(const Op& op, std::span<const Array* const> operands);

// The group's result from its inputs' values (one per FusionGroup::inputs entry, in order).
PARTIR_ENTRY Array eval_fused(const FusionGroup& g, std::span<const Array* const> inputs);

}  // namespace partir

#if PARTIR_DEFINE_ENTRIES
#include "partir/runtime/kernels/kernels.hpp"  // and fused_kernel.hpp, at its end
#endif

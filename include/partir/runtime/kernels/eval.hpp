#pragma once
// The kernels' entry points: one op, or one fused group, computed from its operands' values.
// Header-only (the default): the definitions follow (kernels.hpp, fused_kernel.hpp), so every
// translation unit that includes this compiles the kernels (Eigen, oneDNN: most of a TU's compile time).
// With PARTIR_SEPARATE_COMPILATION these are declarations only and libpartir (src/libpartir.cpp) holds the
// one definition: link it (Meson: dependency('partir-compiled'); pkg-config: partir-compiled).
#include <span>

#include "partir/ir/op.hpp"
#include "partir/runtime/kernels/array.hpp"
#include "partir/runtime/kernels/fusion.hpp"

#if defined(PARTIR_SEPARATE_COMPILATION)
#define PARTIR_KERNEL_ENTRY
#else
#define PARTIR_KERNEL_ENTRY inline
#endif

namespace partir {

// Computes one op from its operand values. Inputs have no kernel: whoever runs the program binds them.
// Float to i32 conversion truncates toward zero.
PARTIR_KERNEL_ENTRY Array eval(const Op& op, std::span<const Array* const> operands);

// The group's result from its inputs' values (one per FusionGroup::inputs entry, in order).
PARTIR_KERNEL_ENTRY Array eval_fused(const FusionGroup& g, std::span<const Array* const> inputs);

}  // namespace partir

#if !defined(PARTIR_SEPARATE_COMPILATION)
#include "partir/runtime/kernels/kernels.hpp"  // and fused_kernel.hpp, at its end
#endif

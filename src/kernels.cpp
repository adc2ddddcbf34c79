// libpartir: the CPU kernels compiled once, for programs built with PARTIR_SEPARATE_COMPILATION
// (runtime/kernels/eval.hpp declares what this defines).
#define PARTIR_SEPARATE_COMPILATION
#define PARTIR_COMPILING_LIBRARY
#include "partir/runtime/kernels/kernels.hpp"

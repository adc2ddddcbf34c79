// libpartir, for programs built with PARTIR_SEPARATE_COMPILATION: the CPU kernels (runtime/kernels/eval.hpp
// declares what this defines) and the executor for the threads backend, each compiled once.
#define PARTIR_SEPARATE_COMPILATION
#define PARTIR_COMPILING_LIBRARY
#include "partir/runtime/executor.hpp"
#include "partir/runtime/kernels/kernels.hpp"

namespace partir {
template DeviceResult execute(const SpmdProgram&, threads::Communicator&, const NamedArrays&, ExecuteOptions);
}  // namespace partir

// libpartir, for programs built with PARTIR_SEPARATE_COMPILATION: the one definition of every PARTIR_ENTRY
// function (config.hpp) and the executor for the threads backend.
#define PARTIR_SEPARATE_COMPILATION
#define PARTIR_COMPILING_LIBRARY
#include "partir/partir.hpp"

namespace partir {
template DeviceResult execute(const ExecutionPlan&, threads::Communicator&, const NamedArrays&, const ExecuteOptions&);
template class Executable<threads::Communicator>;
}  // namespace partir

// The examples' training loop for each backend the build has, compiled once (library examples_common) rather
// than in every example.
#define PARTIR_EXAMPLES_LIBRARY
#include "training_loop.hpp"

namespace examples {

template Trained train(const p::Executable<p::threads::Communicator>&, const BatchFn&, const LoopOptions&);
#ifdef PARTIR_EXAMPLES_MPI
template Trained train(const p::Executable<p::mpi::Communicator>&, const BatchFn&, const LoopOptions&);
#endif
#ifdef PARTIR_EXAMPLES_NCCL
template Trained train(const p::Executable<p::nccl::Communicator>&, const BatchFn&, const LoopOptions&);
#endif

}  // namespace examples

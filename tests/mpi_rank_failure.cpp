// Run under mpirun (4 ranks) by rank_failure.py: only rank 2 is given a bad input, after every rank has
// entered the step; the other ranks block in the step's collectives. The job must end on every rank with
// rank 2's message and a non-zero exit, not hang.
#include <partir/partir.hpp>
#include <partir/runtime/mpi.hpp>

namespace p = partir;

int main(int argc, char** argv) {
  p::mpi::Session session(argc, argv);
  p::mpi::abort_on_error([&] {
    p::nn::Mlp model{"params/mlp", {8, 16, 8}};
    const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                          p::Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}});
    const p::SpmdProgram spmd = p::lower(p::partition(step, p::Mesh{{"batch", 4}}, {p::data_parallel("batch")}));
    p::mpi::Communicator comm;
    p::NamedArrays inputs = p::init_inputs(step, 0, true);
    if (comm.device() == 2) inputs.at("x") = p::Array(p::TensorType{{16, 9}});
    p::execute(spmd, comm, inputs);
  });
  return 0;  // not reached on a correct run of this test: rank 2 aborts the job
}

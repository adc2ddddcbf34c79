// Run under mpirun (4 ranks) by rank_failure.py: only rank 2 is given a bad input, after every rank has
// entered the step; the other ranks block in the step's collectives. The job must end on every rank with
// rank 2's message and a non-zero exit, not hang.
//   (no argument) rank 2's input has the wrong shape: it fails before running any op.
//   in-flight     rank 2's token ids are out of range: it fails in the embedding's gather, while the other
//                 ranks go on computing with the loss's all_reduce and the gradient reductions handed to their
//                 communication streams (non-blocking), which wait for rank 2.
//   killed        rank 2 is killed (SIGKILL) while the others wait for it inside a shared-memory all_reduce.
#include <partir/partir.hpp>
#include <partir/runtime/comm/mpi.hpp>

#include <chrono>
#include <csignal>
#include <string>
#include <thread>
#include <vector>

namespace p = partir;

int main(int argc, char** argv) {
  p::mpi::Session session(argc, argv);
  p::mpi::abort_on_error([&] {
    const std::string mode = argc > 1 ? argv[1] : "";
    const bool in_flight = mode == "in-flight";
    p::mpi::Communicator comm;
    if (mode == "killed") {
      std::vector<float> x(std::size_t{1} << 20, 1.0f);
      if (comm.device() == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others are in the collective by now
        std::raise(SIGKILL);
      }
      comm.all_reduce(p::Group{{0, 1, 2, 3}}, x.data(), static_cast<std::int64_t>(x.size()), p::DType::f32);
      return;
    }
    if (in_flight) {
      const p::nn::Embedding embed{"params/embed", 10, 8};
      const p::nn::Mlp head{"params/head", {8, 16, 8}};
      const p::Program step = p::train_step([&](p::Tensor ids, p::Tensor y) { return p::mse(head(embed(ids)), y); },
                                            p::SGD{0.1}, {{"ids", {16}, p::DType::i32}, {"y", {16, 8}}});
      const p::SpmdProgram spmd = p::lower(p::partition(step, p::Mesh{{"batch", 4}}, {p::data_parallel("batch")}));
      p::NamedArrays inputs = p::init_inputs(step, 0, true);
      if (comm.device() == 2) inputs.at("ids") = p::Array(p::Shape{16}, std::vector<std::int32_t>(16, 99));
      p::execute(spmd, comm, inputs);
      return;
    }
    p::nn::Mlp model{"params/mlp", {8, 16, 8}};
    const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                          p::Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}});
    const p::SpmdProgram spmd = p::lower(p::partition(step, p::Mesh{{"batch", 4}}, {p::data_parallel("batch")}));
    p::NamedArrays inputs = p::init_inputs(step, 0, true);
    if (comm.device() == 2) inputs.at("x") = p::Array(p::TensorType{{16, 9}});
    p::execute(spmd, comm, inputs);
  });
  return 0;  // not reached on a correct run of this test: rank 2 aborts the job
}

// Run under mpirun: the MLP train step partitioned by a schedule, on the MPI backend, must give every rank
// the outputs the single-device interpreter computes, step after step (state carried as local shards), by
// execute() and by an Executable. With PRECISION bf16 or f16 (MixedPrecision) the single-device program is the
// same 16-bit program; partial sums rounded at other points allow a few 16-bit ulps (see test_transformer).
// usage: mpi_train MESH SCHEDULE [PRECISION]
#include <partir/partir.hpp>
#include <partir/runtime/mpi.hpp>

#include <cmath>
#include <cstdio>

namespace p = partir;

int main(int argc, char** argv) {
  p::mpi::Session session(argc, argv);
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: mpi_train MESH SCHEDULE [PRECISION]\n");
    return 2;
  }
  try {
    const p::MixedPrecision precision = p::MixedPrecision::parse(argc == 4 ? argv[3] : "f32");
    const double tolerance = precision.compute == p::DType::f32 ? 1e-5 : 3e-2;
    p::nn::Mlp model{"params/mlp", {8, 32, 16, 8}};
    const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                          p::Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}}, precision);
    const p::SpmdProgram spmd = p::lower(p::partition(step, p::Mesh::parse(argv[1]), p::parse_schedule(argv[2])));
    p::mpi::Communicator comm;
    p::NamedArrays state = p::init_inputs(step, 3, true), local;
    for (const auto& b : spmd.inputs())
      local[b.name] = p::layout::shard(state.at(b.name), b.sharding, spmd.mesh(), comm.device());
    double worst = 0;
    for (int s = 0; s < 3; ++s) {
      p::NamedArrays expect = p::interpret(step, state);
      p::DeviceResult got = p::execute(spmd, comm, local, {.global_inputs = false, .global_outputs = false});
      for (const auto& b : spmd.outputs()) {
        const p::Array want = p::layout::shard(expect.at(b.name), b.sharding, spmd.mesh(), comm.device());
        const p::Array& have = got.outputs.at(b.name);
        for (std::int64_t i = 0; i < want.size(); ++i)
          worst = std::max(worst, std::abs(want.at(i) - have.at(i)) / (1 + std::abs(want.at(i))));
      }
      p::carry_state(step, state, std::move(expect));
      p::carry_state(step, local, std::move(got.outputs));
    }
    // The same three steps through an Executable (whole batch in, pieces of the state carried): its gathered
    // state must equal what the interpreter carried.
    const p::Executable exe(spmd, comm);
    p::NamedArrays pieces = exe.init(3), batch{{"x", state.at("x")}, {"y", state.at("y")}};
    for (int s = 0; s < 3; ++s) exe.step(pieces, batch);
    for (const auto& [name, have] : exe.gather_state(pieces)) {
      const p::Array& want = state.at(name);
      for (std::int64_t i = 0; i < want.size(); ++i)
        worst = std::max(worst, std::abs(want.at(i) - have.at(i)) / (1 + std::abs(want.at(i))));
    }
    double all = 0;
    MPI_Allreduce(&worst, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (comm.device() == 0)
      std::printf("mpi_train %s %s %s: %zu collectives, max relative error %.3g over 3 steps\n", argv[1], argv[2],
                  std::string(p::name_of(precision.compute)).c_str(), spmd.collectives().size(), all);
    return all < tolerance ? 0 : 1;
  } catch (const p::UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

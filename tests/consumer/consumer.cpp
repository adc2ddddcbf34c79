// The README's "Using it" flow, as a downstream project writes it (smaller sizes): a train step, a plan,
// its explanation and simulation, and a training loop on 4 threads whose losses must equal the
// single-device interpreter's. argv[1] names the GEMM engine the build must have chosen.
#include <partir/partir.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  namespace p = partir;
  std::cout << "gemm engine: " << p::name_of(p::gemm_engine()) << "\n";
  if (argc > 1 && p::name_of(p::gemm_engine()) != argv[1]) return 1;
  if (!p::built_in(p::GemmEngine::onednn)) {  // the diagnostic of an engine the build lacks
    try {
      p::set_gemm_engine(p::GemmEngine::onednn);
      return 1;
    } catch (const p::UserError& e) {
      std::cout << e.what() << "\n";
    }
  }
  p::nn::Mlp model{"params/mlp", {16, 64, 16}};
  const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); }, p::Adam{1e-2},
                                        {{"x", {32, 16}}, {"y", {32, 16}}});
  const p::Mesh mesh{{"batch", 2}, {"model", 2}};
  const p::Partitioned plan = p::partition(step, mesh, {p::data_parallel("batch"), p::megatron("model"), p::zero3("batch")});
  std::cout << p::explain(plan, "params/mlp/w1") << p::simulate(p::lower(plan), p::HardwareProfile::detect()) << "\n";

  auto batch = [&](int s) {
    p::NamedArrays all = p::init_inputs(step, 100 + static_cast<std::uint64_t>(s), true);
    return p::NamedArrays{{"x", all.at("x")}, {"y", all.at("y")}};
  };
  p::NamedArrays whole = p::init_inputs(step, 0);
  std::vector<double> want;
  for (int s = 0; s < 3; ++s) {
    p::NamedArrays in = whole;
    in.merge(batch(s));
    p::NamedArrays out = p::interpret(step, in);
    want.push_back(out.at("loss").at(0));
    p::carry_state(step, whole, std::move(out));
  }

  std::vector<double> error(4, 0);  // per device
  p::threads::run(4, [&](p::threads::Communicator& comm) {
    auto exe = p::compile(plan, comm);
    p::NamedArrays state = exe.init(/*seed=*/0);
    for (int s = 0; s < 3; ++s) {
      const double loss = exe.step(state, batch(s)).outputs.at("loss").at(0);
      if (comm.device() == 0) std::cout << "step " << s << " loss " << loss << "\n";
      double& e = error[static_cast<std::size_t>(comm.device())];
      e = std::max(e, std::abs(loss - want[static_cast<std::size_t>(s)]));
    }
  });
  const double worst = *std::max_element(error.begin(), error.end());
  std::cout << "max |partitioned - single-device| loss: " << worst << "\n";
  return worst < 1e-5 ? 0 : 1;
}

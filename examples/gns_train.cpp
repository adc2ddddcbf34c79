// Trains a graph network simulator (GNS, Sanchez-Gonzalez et al. 2020: encode, K message-passing steps of edge
// and node MLPs with residuals, decode) to predict the accelerations of particles joined by springs. Each step
// draws `graphs` systems of `particles` particles in the unit square with random velocities; each particle
// receives an edge from its `neighbours` nearest. The target is Hooke's law with rest length and damping:
//   a_i = sum_j stiffness (|d_ij| - rest) d_ij / |d_ij| - damping v_i,   d_ij = x_j - x_i
// Node features are velocities, edge features the displacement and distance: the model must learn the
// nonlinear spring law from relative geometry, as a GNS does.
// Edges are the batch of a graph network: `bp` splits the edges (each device gathers the node latents its edges
// read, and its scatter-add of messages is a partial sum over the axis), `mp` the MLPs' features (Megatron).
//   build/examples/gns_train
//   build/examples/gns_train --mesh batch=2,model=2 --schedule bp,mp
//   mpirun -np 4 build/examples/gns_train --backend mpi --mesh batch=2,model=2 --schedule bp,mp,z3
#include <partir/partir.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "cli.hpp"
#include "plan_summary.hpp"
#include "training_loop.hpp"

namespace p = partir;

namespace {

// Two-layer MLP over the sum of its inputs' projections (a concatenation's dense layer, without the concat):
// name/in<i>/w1 per input, name/b1, then relu, name/w2, name/b2. Megatron splits w1's outputs and w2's inputs.
p::Tensor mlp(const std::string& name, const std::vector<p::Tensor>& inputs, std::int64_t width) {
  p::Tensor pre = p::nn::dense(inputs[0], name + "/in0/w1", name + "/b1", inputs[0].dim(-1), width);
  for (std::size_t i = 1; i < inputs.size(); ++i)
    pre = pre + p::nn::dense(inputs[i], name + "/in" + std::to_string(i) + "/w1", "", inputs[i].dim(-1), width, false);
  return p::nn::dense(p::relu(pre), name + "/w2", name + "/b2", width, width);
}

struct Gns {
  std::int64_t nodes, edges, width, steps;
  // velocities [N, 2], edge features [M, 3], senders and receivers [M] i32 -> accelerations [N, 2]
  p::Tensor operator()(const p::Tensor& velocity, const p::Tensor& edge_features, const p::Tensor& senders,
                       const p::Tensor& receivers) const {
    p::Tensor h = mlp("params/encoder/node", {velocity}, width);
    p::Tensor e = mlp("params/encoder/edge", {edge_features}, width);
    for (std::int64_t k = 0; k < steps; ++k) {
      const std::string at = "params/processor/" + std::to_string(k);
      e = e + mlp(at + "/edge", {e, p::gather(h, senders), p::gather(h, receivers)}, width);
      h = h + mlp(at + "/node", {h, p::scatter_add(receivers, e, {nodes, width})}, width);
    }
    return p::nn::dense(h, "params/decoder/w", "params/decoder/b", width, 2);
  }
};

// Step `step`'s systems, the same on every device (std::mt19937_64's output is fixed by the standard).
p::NamedArrays systems_at(std::int64_t graphs, std::int64_t particles, std::int64_t neighbours, std::uint64_t seed,
                          long step) {
  constexpr double stiffness = 8, rest = 0.15, damping = 0.5;
  std::mt19937_64 rng(seed * 1000003 + static_cast<std::uint64_t>(step));
  std::uniform_real_distribution<double> unit(0, 1), speed(-1, 1);
  const std::int64_t N = graphs * particles, M = N * neighbours;
  std::vector<double> x(static_cast<std::size_t>(2 * N)), v(x.size());
  for (auto& c : x) c = unit(rng);
  for (auto& c : v) c = speed(rng);
  std::vector<float> velocity(v.begin(), v.end()), accel(x.size()), features;
  std::vector<std::int32_t> senders, receivers;
  for (std::int64_t g = 0; g < graphs; ++g)
    for (std::int64_t i = g * particles; i < (g + 1) * particles; ++i) {
      auto d = [&](std::int64_t j, int c) { return x[static_cast<std::size_t>(2 * j + c)] - x[static_cast<std::size_t>(2 * i + c)]; };
      std::vector<std::int64_t> others;
      for (std::int64_t j = g * particles; j < (g + 1) * particles; ++j)
        if (j != i) others.push_back(j);
      std::partial_sort(others.begin(), others.begin() + neighbours, others.end(), [&](auto a, auto b) {
        return std::hypot(d(a, 0), d(a, 1)) < std::hypot(d(b, 0), d(b, 1));
      });
      double a[2] = {0, 0};
      for (std::int64_t n = 0; n < neighbours; ++n) {
        const std::int64_t j = others[static_cast<std::size_t>(n)];
        const double dist = std::hypot(d(j, 0), d(j, 1));
        for (int c = 0; c < 2; ++c) a[c] += stiffness * (dist - rest) * d(j, c) / dist;
        senders.push_back(static_cast<std::int32_t>(j));
        receivers.push_back(static_cast<std::int32_t>(i));
        features.insert(features.end(), {static_cast<float>(d(j, 0)), static_cast<float>(d(j, 1)), static_cast<float>(dist)});
      }
      for (int c = 0; c < 2; ++c)
        accel[static_cast<std::size_t>(2 * i + c)] = static_cast<float>(a[c] - damping * v[static_cast<std::size_t>(2 * i + c)]);
    }
  return {{"velocity", p::Array({N, 2}, std::move(velocity))}, {"edge_features", p::Array({M, 3}, std::move(features))},
          {"senders", p::Array({M}, std::move(senders))},      {"receivers", p::Array({M}, std::move(receivers))},
          {"acceleration", p::Array({N, 2}, std::move(accel))}};
}

// The schedule: `bp` splits the edges (the edge-indexed inputs on dim 0); every other tactic as the presets say.
p::Schedule gns_schedule(const std::string& text) {
  p::Schedule out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    if (item == "bp")
      out.push_back(p::ManualPartition{{{"edge_features", 0}, {"senders", 0}, {"receivers", 0}}, "batch", "bp(batch): edges"});
    else
      for (auto& t : p::parse_schedule(item)) out.push_back(std::move(t));
    start = end + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Trains a graph network simulator on springs between particles with partir.", "gns_train");
  long steps = 300, graphs = 4, particles = 32, neighbours = 4, width = 64, message_steps = 2, seed = 0;
  app.add_option("--steps", steps, "training steps")->check(cli::at_least(1));
  app.add_option("--graphs", graphs, "particle systems per step")->check(cli::at_least(1));
  app.add_option("--particles", particles, "particles per system")->check(cli::at_least(2));
  app.add_option("--neighbours", neighbours, "edges into each particle, from its nearest")->check(cli::at_least(1));
  app.add_option("--width", width, "latent width of nodes, edges and MLPs")->check(cli::at_least(1));
  app.add_option("--message-steps", message_steps, "message-passing steps (K)")->check(cli::at_least(1));
  app.add_option("--seed", seed, "seed of parameters and systems");
  examples::RunFlags run(app, "batch=2,model=2", "bp,mp",
                         "tactics in order: bp (the edges), mp, z2, z3 on axes batch and model (comma-separated), or none",
                         "gns_train_report.json");
  const examples::RecipeFlags recipe_flags(app, 1e-3);
  const examples::LoopFlags loop(app);
  app.parse(argc, argv);
  const examples::Recipe recipe = recipe_flags.recipe(steps);

  try {
    if (neighbours >= particles)
      p::user_error("--neighbours " + std::to_string(neighbours) + ": must be fewer than --particles " + std::to_string(particles));
    const std::int64_t N = graphs * particles, M = N * neighbours;
    const Gns model{N, M, width, message_steps};
    const p::MixedPrecision precision = loop.mixed_precision();
    const p::Program step = recipe.train_step(
        [&](p::Tensor velocity, p::Tensor edge_features, p::Tensor senders, p::Tensor receivers, p::Tensor target) {
          return p::mse(model(velocity, edge_features, senders, receivers), target);
        },
        {{"velocity", {N, 2}},
         {"edge_features", {M, 3}},
         {"senders", {M}, p::DType::i32},
         {"receivers", {M}, p::DType::i32},
         {"acceleration", {N, 2}}},
        precision);
    const p::Mesh mesh = p::Mesh::parse(run.mesh);
    const p::Partitioned plan = examples::partition_and_report(step, mesh, gns_schedule(run.schedule));
    const p::SpmdProgram spmd = p::lower(plan, loop.lower_options());
    if (examples::lead_process())
      examples::print_plan_summary(std::cout, plan, spmd, run.schedule, "params/processor/0/edge/in0/w1");
    auto next_batch = [&](long s) { return systems_at(graphs, particles, neighbours, static_cast<std::uint64_t>(seed), s); };
    const examples::LoopOptions options = examples::loop_options("gns_train", run, loop, recipe, mesh, steps, seed, M);
    examples::run_on_backend(run.backend, mesh.num_devices(), argc, argv,
                             [&](auto& c) { examples::train(p::Executable(spmd, c), next_batch, options); });
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}

// Trains an MLP regressor on a synthetic teacher task: targets are sin(2 x @ A) for a fixed random A, so the
// loss can fall far below the variance of the targets. The train step (forward, backward, Adam) is one
// partir Program; the schedule partitions it over the mesh, and the same SPMD program runs on N threads of
// this process or on N MPI ranks. Before training it prints the plan (per tactic, a weight's tiles and why,
// the collectives); after, the check of the trained parameters against the single-device program.
//   build/examples/mlp_train                     (the demo: batch=2,model=2 with bp,mp,z3 on 4 threads)
//   build/examples/mlp_train --mesh batch=4 --schedule bp,z2 --steps 100
//   mpirun -np 4 build/examples/mlp_train --backend mpi --mesh batch=2,model=2 --schedule bp,mp
#include <partir/partir.hpp>

#include <cmath>
#include <random>

#include "cli.hpp"
#include "plan_summary.hpp"
#include "training_loop.hpp"

namespace p = partir;

int main(int argc, char** argv) {
  cli::App app("Trains an MLP on a synthetic regression task with partir.", "mlp_train");
  long steps = 200, batch = 256, hidden = 256, features = 16, seed = 0;
  bool no_check = false;
  app.add_option("--steps", steps, "training steps")->check(cli::at_least(1));
  app.add_option("--batch", batch, "examples per step (global)")->check(cli::at_least(1));
  app.add_option("--hidden", hidden, "hidden layer width")->check(cli::at_least(1));
  app.add_option("--features", features, "input and output features")->check(cli::at_least(1));
  app.add_option("--seed", seed, "seed of parameters and data");
  examples::RunFlags run(app, "batch=2,model=2", "bp,mp,z3",
                         "tactics in order: bp, mp, z2, z3, auto:model (comma-separated), or none", "mlp_train_report.json");
  const examples::RecipeFlags recipe_flags(app, 3e-3);
  const examples::LoopFlags loop(app);
  app.add_flag("--no-check", no_check, "skip the check against the single-device program after training");
  app.parse(argc, argv);
  const examples::Recipe recipe = recipe_flags.recipe(steps);
  const bool check = !no_check;

  try {
    p::nn::Mlp model{"params/mlp", {features, hidden, hidden, features}};
    const p::MixedPrecision precision = loop.mixed_precision();
    const p::Program step = recipe.train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                              {{"x", {batch, features}}, {"y", {batch, features}}}, precision);
    const p::Mesh mesh = p::Mesh::parse(run.mesh);
    const p::Partitioned plan = examples::partition_and_report(step, mesh, p::parse_schedule(run.schedule));
    const p::SpmdProgram spmd = p::lower(plan, loop.lower_options());
    if (examples::lead_process()) examples::print_plan_summary(std::cout, plan, spmd, run.schedule, "params/mlp/w1");

    std::mt19937_64 teacher_rng(static_cast<std::uint64_t>(seed) + 1);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> teacher(static_cast<std::size_t>(features * features));
    for (auto& a : teacher) a = normal(teacher_rng) / std::sqrt(static_cast<float>(features));
    auto next_batch = [&](long s) {
      std::mt19937_64 rng(static_cast<std::uint64_t>(seed) * 1000003 + static_cast<std::uint64_t>(s));
      std::normal_distribution<float> gauss(0.f, 1.f);
      std::vector<float> x(static_cast<std::size_t>(batch * features)), y(x.size());
      for (auto& v : x) v = gauss(rng);
      // k outer: each dot still sums k = 0, 1, ... in order, and the inner loop runs along a teacher row.
      std::vector<float> dot(static_cast<std::size_t>(features));
      for (long b = 0; b < batch; ++b) {
        std::fill(dot.begin(), dot.end(), 0.f);
        for (long k = 0; k < features; ++k)
          for (long j = 0; j < features; ++j) dot[j] += x[b * features + k] * teacher[k * features + j];
        for (long j = 0; j < features; ++j) y[b * features + j] = std::sin(2.f * dot[j]);
      }
      return p::NamedArrays{{"x", p::Array({batch, features}, std::move(x))},
                            {"y", p::Array({batch, features}, std::move(y))}};
    };
    examples::LoopOptions options = examples::loop_options("mlp_train", run, loop, recipe, mesh, steps, seed, batch);
    // The same steps on one device (the interpreter, from the same initial state and batches): the partitioned
    // run must end with the same parameters and loss, up to float rounding in a different order.
    if (check)
      options.check_single_device = [&](const p::NamedArrays& trained, double loss) {
        p::NamedArrays state = p::init_inputs(step, static_cast<std::uint64_t>(seed));
        double single_loss = 0;
        for (long s = 1; s <= steps; ++s) {
          p::NamedArrays in = state;
          in.merge(next_batch(s));
          in.merge(recipe.step_inputs(s));
          p::NamedArrays out = p::interpret(step, in);
          single_loss = out.at("loss").at(0);
          p::carry_state(step, state, std::move(out));
        }
        double worst = 0;
        std::string where;
        for (const auto& [name, a] : trained) {
          const p::Array& b = state.at(name);
          for (std::int64_t i = 0; i < a.size(); ++i)
            if (const double d = std::abs(a.at(i) - b.at(i)); d > worst) worst = d, where = name;
        }
        std::cout << "check vs single device: max |difference| " << worst << " over " << trained.size()
                  << " state arrays" << (where.empty() ? "" : " (largest in " + where + ")") << ", final loss "
                  << std::setprecision(6) << single_loss << " vs " << loss << std::endl;
      };
    examples::run_on_backend(run.backend, mesh.num_devices(), argc, argv,
                             [&](auto& c) { examples::train(p::Executable(spmd, c), next_batch, options); });
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}

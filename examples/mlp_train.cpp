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
  cli::Args args(argc, argv, "usage: mlp_train [flags]\nTrains an MLP on a synthetic regression task with partir.");
  const long steps = args.get_int("steps", 200, "training steps");
  const long batch = args.get_int("batch", 256, "examples per step (global)");
  const long hidden = args.get_int("hidden", 256, "hidden layer width");
  const long features = args.get_int("features", 16, "input and output features");
  const long seed = args.get_int("seed", 0, "seed of parameters and data");
  const std::string mesh_text = args.get("mesh", "batch=2,model=2", "device mesh, axes major to minor");
  const std::string schedule_text = args.get("schedule", "bp,mp,z3", "tactics in order: bp, mp, z2, z3, auto:model (comma-separated), or none");
  const examples::Recipe recipe = examples::recipe_flags(args, steps, 3e-3);
  const long log_every = examples::log_every_flag(args, steps);
  const p::MixedPrecision precision = examples::precision_flag(args);
  const bool check = !args.get_flag("no-check", "skip the check against the single-device program after training");
  const std::string backend = args.get("backend", "threads", "threads (one process), mpi (under mpirun) or nccl (one GPU per device)");
  const std::string report = args.get("report", "", "'json' writes a JSON report of the run");
  const std::string report_file = args.get("report-file", "mlp_train_report.json", "where --report json writes");
  const examples::CheckpointOptions checkpoint = examples::checkpoint_flags(args);
  args.finish();

  try {
    p::nn::Mlp model{"params/mlp", {features, hidden, hidden, features}};
    const p::Program step = recipe.train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                              {{"x", {batch, features}}, {"y", {batch, features}}}, precision);
    const p::Mesh mesh = p::Mesh::parse(mesh_text);
    const p::Partitioned plan = examples::partition_and_report(step, mesh, p::parse_schedule(schedule_text));
    const p::SpmdProgram spmd = p::lower(plan);
    if (examples::lead_process()) examples::print_plan_summary(std::cout, plan, spmd, schedule_text, "params/mlp/w1");

    std::mt19937_64 teacher_rng(static_cast<std::uint64_t>(seed) + 1);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> teacher(static_cast<std::size_t>(features * features));
    for (auto& a : teacher) a = normal(teacher_rng) / std::sqrt(static_cast<float>(features));
    auto next_batch = [&](long s) {
      std::mt19937_64 rng(static_cast<std::uint64_t>(seed) * 1000003 + static_cast<std::uint64_t>(s));
      std::normal_distribution<float> gauss(0.f, 1.f);
      std::vector<float> x(static_cast<std::size_t>(batch * features)), y(x.size());
      for (auto& v : x) v = gauss(rng);
      for (long b = 0; b < batch; ++b)
        for (long j = 0; j < features; ++j) {
          float dot = 0;
          for (long k = 0; k < features; ++k) dot += x[b * features + k] * teacher[k * features + j];
          y[b * features + j] = std::sin(2.f * dot);
        }
      return p::NamedArrays{{"x", p::Array({batch, features}, std::move(x))},
                            {"y", p::Array({batch, features}, std::move(y))}};
    };
    examples::LoopOptions options{steps, static_cast<std::uint64_t>(seed), batch,
                                  report == "json" ? report_file : "",
                                  "mlp_train mesh " + mesh.to_string() + " schedule " + schedule_text + " backend " + backend +
                                      " precision " + std::string(name_of(precision.compute)),
                                  checkpoint, log_every, recipe};
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
    if (!report.empty() && report != "json") p::user_error("--report: expected 'json', got '" + report + "'");

    examples::run_on_backend(backend, mesh.num_devices(), argc, argv,
                             [&](auto& c) { examples::train(p::Executable(spmd, c), next_batch, options); });
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}

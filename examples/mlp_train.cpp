// Trains an MLP regressor on a synthetic teacher task: targets are sin(x @ A) for a fixed random A, so the
// loss can fall far below the variance of the targets. The train step (forward, backward, Adam) is one
// partir Program; the loop feeds it fresh batches and carries parameters and optimizer state.
#include <partir/partir.hpp>

#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <random>

#include "cli.hpp"

namespace p = partir;

int main(int argc, char** argv) {
  cli::Args args(argc, argv, "usage: mlp_train [flags]\nTrains an MLP on a synthetic regression task with partir.");
  const long steps = args.get_int("steps", 200, "training steps");
  const long batch = args.get_int("batch", 64, "examples per step");
  const long hidden = args.get_int("hidden", 128, "hidden layer width");
  const long features = args.get_int("features", 16, "input and output features");
  const long seed = args.get_int("seed", 0, "seed of parameters and data");
  const double lr = args.get_double("lr", 3e-3, "Adam learning rate");
  args.finish();

  try {
    p::nn::Mlp model{"params/mlp", {features, hidden, hidden, features}};
    p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                    p::Adam{lr}, {{"x", {batch, features}}, {"y", {batch, features}}});
    p::NamedArrays state = p::init_inputs(step, static_cast<std::uint64_t>(seed));

    std::mt19937_64 rng(static_cast<std::uint64_t>(seed) + 1);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> teacher(static_cast<std::size_t>(features * features));
    for (auto& a : teacher) a = normal(rng) / std::sqrt(static_cast<float>(features));

    double loss = 0;
    for (long s = 1; s <= steps; ++s) {
      std::vector<float> x(static_cast<std::size_t>(batch * features)), y(x.size());
      for (auto& v : x) v = normal(rng);
      for (long b = 0; b < batch; ++b)
        for (long j = 0; j < features; ++j) {
          float dot = 0;
          for (long k = 0; k < features; ++k) dot += x[b * features + k] * teacher[k * features + j];
          y[b * features + j] = std::sin(2.f * dot);
        }
      state["x"] = p::Array({batch, features}, std::move(x));
      state["y"] = p::Array({batch, features}, std::move(y));

      auto start = std::chrono::steady_clock::now();
      p::NamedArrays outputs = p::interpret(step, state);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      loss = outputs.at("loss").at(0);
      p::carry_state(step, state, std::move(outputs));
      std::cout << "step " << s << " loss " << std::setprecision(6) << loss << " ms " << std::setprecision(3) << ms
                << "\n";
    }
    std::cout << "final loss " << std::setprecision(6) << loss << "\n";
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}

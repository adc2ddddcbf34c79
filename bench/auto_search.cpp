// AutomaticPartition search time on a 12-layer GPT train step (Adam; forward, backward and update in one
// program) on a batch=2,model=2 mesh, BP on batch first, the search on model: MCTS and greedy, each with its
// chosen plan's predicted step time and peak memory next to Megatron's (target: under 10 s on 2 cores).
//   build/bench/auto_search [evaluations=32] [layers=12]
#include <partir/autodiff/train_step.hpp>
#include <partir/dsl/transformer.hpp>
#include <partir/sim/simulator.hpp>
#include <partir/spmd/lower.hpp>
#include <partir/search/automatic.hpp>
#include <partir/tactics/partition.hpp>
#include <partir/tactics/presets.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "../examples/cli.hpp"

namespace p = partir;

int main(int argc, char** argv) {
  cli::App app("The automatic search on a GPT train step: evaluations, time and the plan it picks.", "auto_search");
  int evaluations = 32;
  std::int64_t layers = 12;
  app.add_option("evaluations", evaluations, "simulator evaluations the search may spend")->check(cli::at_least(1));
  app.add_option("layers", layers, "transformer blocks")->check(cli::at_least(1));
  app.parse(argc, argv);
  const p::nn::GptConfig c{.vocab = 256, .seq = 64, .d_model = 128, .heads = 4, .layers = layers};
  const p::nn::Gpt model{c};
  const p::Program step = p::train_step([&](p::Tensor t, p::Tensor y) { return model.loss(t, y); }, p::Adam{},
                                        {{"tokens", {16, c.seq}, p::DType::i32}, {"targets", {16, c.seq}, p::DType::i32}});
  const p::Mesh mesh{{"batch", 2}, {"model", 2}};
  const p::HardwareProfile hw = p::HardwareProfile::cpu();
  std::printf("%lld-layer GPT train step, %lld ops, mesh %s, profile %s, %u hardware threads\n",
              static_cast<long long>(layers), static_cast<long long>(step.size()), mesh.to_string().c_str(),
              hw.name.c_str(), std::thread::hardware_concurrency());

  auto report = [&](const char* label, const p::Schedule& s) {
    const p::Report r = p::simulate(p::lower(p::partition(step, mesh, s)), hw);
    std::printf("%-22s step %10.3f ms  peak %8.2f MiB\n", label, r.step_seconds * 1e3,
                static_cast<double>(r.peak_bytes) / (1 << 20));
    return r;
  };
  report("bp", {p::data_parallel("batch")});
  const p::Report mp = report("bp,mp (Megatron)", {p::data_parallel("batch"), p::megatron("model")});

  for (const p::SearchBudget& budget : {p::SearchBudget{p::SearchStrategy::mcts, evaluations}, p::greedy(evaluations)}) {
    const p::AutomaticPartition automatic{{"model"}, p::Objective::step_time, 0, budget, hw, {},
                                          std::make_shared<p::SearchReport>()};
    const auto t0 = std::chrono::steady_clock::now();
    const p::Partitioned plan = p::partition(step, mesh, {p::data_parallel("batch"), automatic});
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const p::SearchReport& r = *automatic.report;
    std::printf("\n%s search: %.2f s (partition with the search, %d plans evaluated)%s\n",
                std::string(p::name_of(budget.strategy)).c_str(), seconds, r.evaluations,
                seconds < 10 ? "" : "  (over the 10 s target)");
    std::printf("bp,auto:model          step %10.3f ms  peak %8.2f MiB  (%.3fx Megatron's time, %.3fx its memory)\n",
                r.chosen.step_seconds * 1e3, static_cast<double>(r.chosen.peak_bytes) / (1 << 20),
                r.chosen.step_seconds / mp.step_seconds,
                static_cast<double>(r.chosen.peak_bytes) / static_cast<double>(mp.peak_bytes));
    std::cout << r;
  }
}

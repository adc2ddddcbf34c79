// MLP train step (batch 256, 1024 -> 4096 -> 1024, ReLU, MSE, SGD, fp32) in PyTorch and in partir, one run:
//   1. the matmul peak: oneDNN's best standalone f32 GEMM rate (the MLP's three GEMM shapes and 2048^3, through
//      partir's dot_general kernel), measured first, while no other thread pool has run; in a build without
//      oneDNN, the best engine built in. Then each other engine's 2048^3 rate, for reference;
//   2. PyTorch (bench/vs_pytorch_mlp.py in a child process, OPENBLAS_NUM_THREADS = the budget), skipped with
//      a message when torch is missing;
//   3. partir's interpreter on one device, on every GEMM engine built in (fused), and unfused on the default;
//   4. bf16: PyTorch under torch.autocast("cpu", torch.bfloat16) vs partir under MixedPrecision bf16.
// Prints each step time, GFLOP/s (5 GEMMs: the first layer needs no input gradient) and the ratios:
// partir step vs matmul peak (target >= 0.7), vs PyTorch (target >= 2.0x), and bf16 vs autocast (>= 2.0x).
// Every measurement runs `rounds` times in turn and the best is kept, so that load from other processes
// hits all of them alike. After OpenBLAS runs, the bench waits for its spinning threads to sleep.
// usage: vs_pytorch_mlp [reps] [--rounds 2] [--python PATH] [--script PATH]
#include <partir/partir.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <thread>
#include <tuple>
#include <string>
#include <vector>

#include "../examples/cli.hpp"

namespace p = partir;

namespace {

double median_ms(int reps, const std::function<void()>& fn) {
  fn();  // warm-up: first touch of buffers
  fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// GFLOP/s of dot_general on `engine` for [m,k] @ [k,n] (lhs stored [k,m] when lhs_transposed).
double gemm_gflops(p::GemmEngine engine, long m, long n, long k, bool lhs_transposed, int reps) {
  p::set_gemm_engine(engine);
  const p::Init uniform{p::Init::Kind::uniform, 1.0};
  const p::Array a = p::init_array({lhs_transposed ? p::Shape{k, m} : p::Shape{m, k}, p::DType::f32}, uniform, 1, "a");
  const p::Array b = p::init_array({{k, n}, p::DType::f32}, uniform, 2, "b");
  p::Op dot{p::OpKind::dot_general, {0, 1}, {}, {{m, n}, p::DType::f32}, "gemm"};
  dot.attrs.dot = {{}, {}, {lhs_transposed ? 0 : 1}, {0}};
  const p::Array* operands[] = {&a, &b};
  p::Array c;
  const double ms = median_ms(reps, [&] { c = p::eval(dot, operands); });  // c's old buffer is reused
  return 2.0 * m * n * k / ms / 1e6;
}

// OpenBLAS's threads spin for a while after a call: let them sleep before the next measurement.
void let_pools_sleep() { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

// The median step time PyTorch reports, or a negative value (with the reason printed) when it cannot run.
double torch_ms(const std::string& python, const std::string& script, long batch, long in, long hidden, int reps,
                bool verbose, const std::string& autocast = "none") {
  const std::string cmd = "OPENBLAS_NUM_THREADS=" + std::to_string(p::thread_budget()) + " " + python + " " + script +
                          " --batch " + std::to_string(batch) + " --inputs " + std::to_string(in) + " --hidden " +
                          std::to_string(hidden) + " --reps " + std::to_string(reps) + " --threads " +
                          std::to_string(p::thread_budget()) + " --autocast " + autocast + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) {
    std::printf("pytorch: skipped (cannot run %s)\n", python.c_str());
    return -1;
  }
  double ms = -1;
  char line[512];
  while (std::fgets(line, sizeof line, pipe)) {
    std::string s(line);
    if (s.rfind("torch_step_ms ", 0) == 0) ms = std::atof(s.c_str() + 14);
    else if (verbose) std::printf("pytorch: %s", s.c_str());
  }
  const int rc = pclose(pipe);
  if (ms < 0 && rc != 0 && verbose) std::printf("pytorch: skipped (%s exited with status %d)\n", python.c_str(), rc);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 10, rounds = 2;
  std::string python = std::system("test -x /usr/bin/python3") == 0 ? "/usr/bin/python3" : "python3";  // Debian's torch
  std::string script = PARTIR_BENCH_DIR "/vs_pytorch_mlp.py";
  cli::App app("The MLP train step: partir vs the GEMM peak and vs PyTorch, in one run.", "vs_pytorch_mlp");
  app.add_option("reps", reps, "timed steps per round")->check(cli::at_least(1));
  app.add_option("--rounds", rounds, "rounds, alternating partir and PyTorch (the best counts)")->check(cli::at_least(1));
  app.add_option("--python", python, "the Python with torch");
  app.add_option("--script", script, "the PyTorch side");
  app.parse(argc, argv);
  const long batch = 256, in = 1024, hidden = 4096;
  const float lr = 1e-2f;
  const double flops = 5.0 * 2 * batch * in * hidden;

  const p::GemmEngine best = p::best_gemm_engine();
  std::printf("# MLP train step: batch %ld, %ld-%ld-%ld, ReLU, MSE, SGD, fp32; best of %d medians of %d; %d threads"
              " (GEMM engines built in: %s)\n", batch, in, hidden, in, rounds, reps, p::thread_budget(),
              p::gemm_engines_built_in().c_str());
  p::nn::Mlp model{"params/mlp", {in, hidden, in}};
  const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); }, p::SGD{lr},
                                        {{"x", {batch, in}}, {"y", {batch, in}}});
  const p::Program bf16_step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); },
                                             p::SGD{lr}, {{"x", {batch, in}}, {"y", {batch, in}}},
                                             p::MixedPrecision::with_compute(p::DType::bf16));
  const p::NamedArrays state = p::init_inputs(step, 0, true);
  auto partir_ms = [&](p::GemmEngine engine, bool fuse, const p::Program& program) {
    p::set_gemm_engine(engine);
    p::set_fusion(fuse);
    p::NamedArrays running = state;
    const double ms = median_ms(reps, [&] { p::carry_state(program, running, p::interpret(program, running)); });
    p::kernels::buffer_cache().clear();  // the next variant starts from the same memory conditions
    if (engine == p::GemmEngine::blas) let_pools_sleep();
    return ms;
  };
  // The peak first, before any other pool has spun: the MLP's GEMMs (forward, weight gradient, input
  // gradient) and 2048^3.
  double peak = 0;
  for (int round = 0; round < rounds; ++round)
    for (const auto& [m, n, k, t] : {std::tuple{batch, hidden, in, false}, std::tuple{in, hidden, batch, true},
                                     std::tuple{batch, in, hidden, false}, std::tuple{2048L, 2048L, 2048L, false}})
      peak = std::max(peak, gemm_gflops(best, m, n, k, t, 5));
  std::map<p::GemmEngine, double> square;  // each engine's 2048^3 rate
  for (p::GemmEngine e : p::all_gemm_engines)
    if (p::built_in(e)) {
      square[e] = gemm_gflops(e, 2048, 2048, 2048, false, 3);
      if (e == p::GemmEngine::blas) let_pools_sleep();
    }

  double torch = -1, torch_bf16 = -1, unfused = 1e30, bf16 = 1e30;
  std::map<p::GemmEngine, double> fused;
  for (int round = 0; round < rounds; ++round) {
    const double t = torch_ms(python, script, batch, in, hidden, reps, round == 0);
    if (t > 0) torch = torch < 0 ? t : std::min(torch, t);
    const double t16 = torch_ms(python, script, batch, in, hidden, reps, false, "bf16");
    if (t16 > 0) torch_bf16 = torch_bf16 < 0 ? t16 : std::min(torch_bf16, t16);
    bf16 = std::min(bf16, partir_ms(best, true, bf16_step));
    for (p::GemmEngine e : p::all_gemm_engines)
      if (p::built_in(e)) fused[e] = std::min(fused.count(e) ? fused[e] : 1e30, partir_ms(e, true, step));
    unfused = std::min(unfused, partir_ms(best, false, step));
  }
  p::set_gemm_engine(best);
  p::set_fusion(true);

  std::printf("%-34s %10s %10.1f GFLOP/s  (matmul peak: best of the MLP's GEMMs and 2048^3)\n",
              (std::string(p::name_of(best)) + " f32 matmul peak").c_str(), "", peak);
  for (const auto& [e, rate] : square)
    std::printf("%-34s %10s %10.1f GFLOP/s\n", (std::string(p::name_of(e)) + " f32 2048^3").c_str(), "", rate);
  auto row = [&](const std::string& what, double ms) {
    std::printf("%-34s %7.2f ms %10.1f GFLOP/s %5.0f%% of peak\n", what.c_str(), ms, flops / ms / 1e6,
                100.0 * flops / ms / 1e6 / peak);
  };
  if (torch > 0) row("pytorch", torch);
  if (torch_bf16 > 0) row("pytorch (autocast bf16)", torch_bf16);
  row("partir (" + std::string(p::name_of(best)) + " gemm, bf16)", bf16);
  for (const auto& [e, ms] : fused) row("partir (" + std::string(p::name_of(e)) + " gemm, fused)", ms);
  row("partir (" + std::string(p::name_of(best)) + " gemm, unfused)", unfused);
  const double step_ms = fused.at(best);
  std::printf("partir step vs matmul peak: %.2f (target >= 0.7)\n", flops / step_ms / 1e6 / peak);
  if (torch > 0) std::printf("partir speed vs pytorch: %.2fx (target >= 2.0x)\n", torch / step_ms);
  else std::printf("partir speed vs pytorch: skipped (no torch)\n");
  if (torch_bf16 > 0) std::printf("partir bf16 vs pytorch autocast bf16: %.2fx (target >= 2.0x)\n", torch_bf16 / bf16);
  std::printf("fusion speedup: %.2fx", unfused / step_ms);
  for (const auto& [e, ms] : fused)
    if (e != best) std::printf("; %s vs %s engine: %.2fx", std::string(p::name_of(best)).c_str(),
                               std::string(p::name_of(e)).c_str(), ms / step_ms);
  std::printf("\n");
}

// MLP train step (batch 256, 1024 -> 4096 -> 1024, ReLU, MSE, SGD, fp32) in PyTorch and in partir, one run:
//   1. the GEMM ceiling: cblas_sgemm (or Eigen's product in a -Dblas=none build) on the whole thread budget;
//   2. PyTorch (bench/vs_pytorch_mlp.py in a child process, OPENBLAS_NUM_THREADS = the budget), skipped with
//      a message when torch is missing;
//   3. partir's interpreter on one device: BLAS GEMMs + fusion (the default), BLAS without fusion, and
//      Eigen GEMMs (what -Dblas=none runs).
// Prints each step time, GFLOP/s (5 GEMMs: the first layer needs no input gradient) and the ratios.
// Every measurement runs `rounds` times in turn and the best is kept, so that load from other processes
// hits all of them alike.
// usage: vs_pytorch_mlp [reps] [--rounds 2] [--python PATH] [--script PATH]
#include <partir/partir.hpp>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

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

// GFLOP/s of one n^3 single-precision GEMM on the current engine and thread budget.
double gemm_gflops(int n, int reps) {
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  M a = M::Random(n, n), b = M::Random(n, n), c(n, n);
  const double ms = median_ms(reps, [&] {
    if (!p::blas::gemm<float>(true, true, n, n, n, a.data(), n, b.data(), n, c.data(), n)) c.noalias() = a * b;
  });
  return 2.0 * n * n * n / ms / 1e6;
}

// The median step time PyTorch reports, or a negative value (with the reason printed) when it cannot run.
double torch_ms(const std::string& python, const std::string& script, long batch, long in, long hidden, int reps,
                bool verbose) {
  const std::string cmd = "OPENBLAS_NUM_THREADS=" + std::to_string(p::thread_budget()) + " " + python + " " + script +
                          " --batch " + std::to_string(batch) + " --inputs " + std::to_string(in) + " --hidden " +
                          std::to_string(hidden) + " --reps " + std::to_string(reps) + " --threads " +
                          std::to_string(p::thread_budget()) + " 2>&1";
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
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--python" && i + 1 < argc) python = argv[++i];
    else if (a == "--script" && i + 1 < argc) script = argv[++i];
    else if (a == "--rounds" && i + 1 < argc) rounds = std::max(1, std::atoi(argv[++i]));
    else reps = std::max(1, std::atoi(argv[i]));
  }
  const long batch = 256, in = 1024, hidden = 4096;
  const float lr = 1e-2f;
  const double flops = 5.0 * 2 * batch * in * hidden;

  std::printf("# MLP train step: batch %ld, %ld-%ld-%ld, ReLU, MSE, SGD, fp32; best of %d medians of %d; %d threads"
              " (%s)\n", batch, in, hidden, in, rounds, reps, p::thread_budget(),
              p::blas_built_in ? "OpenBLAS GEMMs built in" : "-Dblas=none: Eigen GEMMs only");
  p::nn::Mlp model{"params/mlp", {in, hidden, in}};
  const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); }, p::SGD{lr},
                                        {{"x", {batch, in}}, {"y", {batch, in}}});
  const p::NamedArrays state = p::init_inputs(step, 0, true);
  auto partir_ms = [&](p::GemmEngine engine, bool fuse) {
    p::set_gemm_engine(engine);
    p::set_fusion(fuse);
    p::NamedArrays running = state;
    const double ms = median_ms(reps, [&] { p::carry_state(step, running, p::interpret(step, running)); });
    p::kernels::buffer_cache().clear();  // the next variant starts from the same memory conditions
    return ms;
  };
  double ceiling = 0, torch = -1, fused = 1e30, unfused = 1e30, eigen = 1e30;
  for (int round = 0; round < rounds; ++round) {
    ceiling = std::max(ceiling, gemm_gflops(2048, 5));
    const double t = torch_ms(python, script, batch, in, hidden, reps, round == 0);
    if (t > 0) torch = torch < 0 ? t : std::min(torch, t);
    fused = std::min(fused, partir_ms(p::GemmEngine::blas, true));
    if (p::blas_built_in) unfused = std::min(unfused, partir_ms(p::GemmEngine::blas, false));
    eigen = std::min(eigen, partir_ms(p::GemmEngine::eigen, true));
  }
  p::set_gemm_engine(p::GemmEngine::blas);
  p::set_fusion(true);
  std::printf("%-34s %10s %10.1f GFLOP/s\n", p::blas_built_in ? "OpenBLAS sgemm 2048^3" : "Eigen sgemm 2048^3", "",
              ceiling);

  auto row = [&](const char* what, double ms) {
    std::printf("%-34s %7.2f ms %10.1f GFLOP/s %5.0f%% of sgemm\n", what, ms, flops / ms / 1e6,
                100.0 * flops / ms / 1e6 / ceiling);
  };
  if (torch > 0) row("pytorch", torch);
  row(p::blas_built_in ? "partir (blas gemm, fused)" : "partir (eigen gemm, fused)", fused);
  if (p::blas_built_in) row("partir (blas gemm, unfused)", unfused);
  row("partir (eigen gemm, fused)", eigen);
  if (torch > 0)
    std::printf("partir speed vs pytorch: %.2fx (target >= 1.0x, aim 1.2x); eigen-only path: %.2fx\n", torch / fused,
                torch / eigen);
  else
    std::printf("partir speed vs pytorch: skipped (no torch)\n");
  if (p::blas_built_in)
    std::printf("fusion speedup: %.2fx; blas vs eigen gemm: %.2fx\n", unfused / fused, eigen / fused);
}

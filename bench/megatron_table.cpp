// Megatron-LM's Table 1 (Narayanan et al. 2021, arXiv 2104.04473: GPT on Selene, DGX A100 80 GB, mixed precision,
// sequence 2048, vocabulary 51,200, activation recomputation) predicted by simulation: each row's GPT built with
// partir's own model at the paper's sizes, partitioned by partir's tactics for its data (bp), tensor (mp) and
// pipeline (pp) parallelism, tensor parallelism inside a node, lowered and simulated on `a100-80gb-selene`. Per row: the
// predicted throughput per GPU counted as the paper counts it (F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs per
// iteration, over the predicted step and the GPU count), the published one and the error; partir's own MFU and
// HFU (its GEMM FLOPs, remat's recomputation out and in); the predicted peak memory per GPU against 80 GB; and the
// time partir took to plan the row (build, partition, lower, simulate).
//
// The rows with pipeline parallelism (PP > 1) run 24-512 microbatches a step (of `--microbatch-size`, default 1,
// sequences): each is planned as a step of 3 microbatches and simulated with simulate_repeated, which replays the
// schedule's tasks for all of them (examples/cluster_plan.hpp; Megatron-LM's interleaved schedule, 2 or 3 chunks
// per device; stages cut by predicted work).
//
// `--gemm-efficiency F` (default 1: the datasheet's peak) sets the profile's GEMM curve flat at F; the figure that
// makes the first row's prediction meet its published throughput is printed last (an estimate: the GEMMs' share
// of the step scaled), as the one calibration the issue allows.
// usage: megatron_table [--gemm-efficiency F] [--microbatch-size N]
#include <partir/partir.hpp>

#include <cmath>
#include <cstdio>

#include "../examples/cli.hpp"
#include "../examples/cluster_plan.hpp"

namespace p = partir;

namespace {

struct Row {
  double params_b;
  std::int64_t heads, hidden, layers, tp, pp, gpus, batch;
  double published_tflops;
};

// Table 1 of the paper.
const std::vector<Row> rows{
    {1.7, 24, 2304, 24, 1, 1, 32, 512, 137},        {3.6, 32, 3072, 30, 2, 1, 64, 512, 138},
    {7.5, 32, 4096, 36, 4, 1, 128, 512, 142},       {18.4, 48, 6144, 40, 8, 1, 256, 1024, 135},
    {39.1, 64, 8192, 48, 8, 2, 512, 1536, 138},     {76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140},
    {145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148},  {310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155},
    {529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163}, {1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163},
};
constexpr std::int64_t seq = 2048, vocab = 51200;

// The paper's FLOPs per iteration (GEMMs, the recomputation's extra forward pass included).
double paper_flops(const Row& r) {
  const double B = static_cast<double>(r.batch), s = seq, l = static_cast<double>(r.layers), h = static_cast<double>(r.hidden);
  return 96 * B * s * l * h * h * (1 + s / (6 * h) + static_cast<double>(vocab) / (16 * l * h));
}

// The row's plan: data parallelism over what TP and PP leave, tensor parallelism last (inside a node), the
// pipeline's stages between; Megatron-LM's interleaved schedule, each device's layers in as few chunks as divide
// them (2, or 3). microbatch_size 0: each device's sequences in one pass (a pipelined row: 1 a microbatch).
examples::Planned plan(const Row& r, const p::HardwareProfile& hw, std::int64_t microbatch_size) {
  const std::int64_t dp = r.gpus / (r.tp * r.pp), per_stage = r.layers / r.pp;
  const int chunks = r.pp == 1 ? 1 : per_stage % 2 == 0 ? 2 : per_stage % 3 == 0 ? 3 : 1;
  std::string schedule = r.tp > 1 ? "bp,mp" : "bp";
  if (r.pp > 1) schedule += chunks > 1 ? ",pp:interleaved:" + std::to_string(chunks) : ",pp";
  return examples::plan_on_cluster(
      {.model = {.vocab = vocab, .seq = seq, .d_model = r.hidden, .heads = r.heads, .layers = r.layers},
       .batch = r.batch,
       .microbatch_size = r.pp > 1 && microbatch_size == 0 ? 1 : microbatch_size,
       .mesh = r.pp > 1 ? p::Mesh{{"batch", dp}, {"stage", r.pp}, {"model", r.tp}} : p::Mesh{{"batch", dp}, {"model", r.tp}},
       .schedule = schedule},
      hw);
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Megatron-LM's Table 1 (GPT on Selene) predicted by partir's simulator.", "megatron_table");
  double efficiency = 1;
  std::int64_t microbatch_size = 0;
  app.add_option("--gemm-efficiency", efficiency, "fraction of the bf16 datasheet peak the GEMMs reach")->check(cli::at_least(1e-3));
  app.add_option("--microbatch-size", microbatch_size,
                 "sequences per microbatch (gradient accumulation over the rest; 0: each device's share at once, 1 in a pipeline)")
      ->check(cli::at_least(0));
  app.parse(argc, argv);
  p::HardwareProfile hw = p::HardwareProfile::builtin("a100-80gb-selene");
  hw.gemm_curve = {{1, efficiency}};
  std::printf("Megatron-LM Table 1 on %s, GEMMs at %.2f of the bf16 peak (%s), %s\n", hw.name.c_str(), efficiency,
              p::human_bytes(static_cast<double>(hw.memory_capacity)).c_str(),
              microbatch_size > 0 ? ("microbatches of " + std::to_string(microbatch_size) + " sequences").c_str()
                                  : "each device's sequences in one pass (pipelines: microbatches of 1)");
  std::printf("%8s %4s %4s %6s %10s %10s %8s %7s %7s %12s %6s %8s\n", "params", "TP", "PP", "GPUs", "predicted",
              "published", "error", "MFU", "HFU", "peak/GPU", "fits", "plan s");
  double worst = 0, first_ratio = 0;
  std::vector<std::pair<double, double>> ranked;  // (predicted, published)
  for (const Row& r : rows) {
    const examples::Planned planned = plan(r, hw, microbatch_size);
    const p::Report& rep = planned.report;
    const double predicted = paper_flops(r) / (rep.step_seconds * static_cast<double>(r.gpus)) / 1e12;
    const double error = predicted / r.published_tflops - 1;
    if (first_ratio == 0) first_ratio = r.published_tflops / predicted;
    worst = std::max(worst, std::abs(error));
    ranked.emplace_back(predicted, r.published_tflops);
    std::printf("%7.1fB %4lld %4lld %6lld %10.1f %10.0f %+7.1f%% %6.1f%% %6.1f%% %12s %6s %8.2f\n", r.params_b,
                static_cast<long long>(r.tp), static_cast<long long>(r.pp), static_cast<long long>(r.gpus), predicted,
                r.published_tflops, 100 * error, 100 * rep.mfu(), 100 * rep.hfu(),
                p::human_bytes(static_cast<double>(rep.peak_bytes)).c_str(), rep.fits() ? "yes" : "NO", planned.seconds);
    std::fflush(stdout);
  }
  // Spearman's rank correlation of the planned rows' predicted and published throughputs.
  auto ranks = [&](bool published) {
    std::vector<double> out(ranked.size());
    for (std::size_t i = 0; i < ranked.size(); ++i)
      for (std::size_t j = 0; j < ranked.size(); ++j) {
        const double a = published ? ranked[i].second : ranked[i].first, b = published ? ranked[j].second : ranked[j].first;
        out[i] += b < a ? 1 : b == a && j != i ? 0.5 : 0;
      }
    return out;
  };
  const auto a = ranks(false), b = ranks(true);
  double d2 = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d2 += (a[i] - b[i]) * (a[i] - b[i]);
  const double n = static_cast<double>(ranked.size());
  std::printf("worst |error|: %.3f (rows planned: %zu of %zu)\n", worst, ranked.size(), rows.size());
  std::printf("rank correlation: %.2f\n", n > 1 ? 1 - 6 * d2 / (n * (n * n - 1)) : 1.0);
  std::printf("GEMM efficiency that meets row 1's published throughput: %.3f\n", efficiency * first_ratio);
}

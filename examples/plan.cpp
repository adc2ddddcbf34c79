// plan: what a GPT train step would do on a cluster, before booking one. Builds the step at the given sizes,
// partitions it by a schedule on a mesh, lowers and simulates it on a hardware profile (a built-in, e.g.
// a100-80gb-selene, h100-sxm, h200, or a JSON file), and prints the predicted step, MFU and HFU, the memory per
// device by kind against the device's capacity, the verdict, and the time it took to plan; nothing is run. A
// step that does not fit gets the fastest one-knob change that would (remat, ZeRO, smaller microbatches).
// A pipeline's microbatches are replayed from 3 (examples/cluster_plan.hpp), so a step of hundreds plans in
// seconds. Example (Megatron-LM's 1T model on 3072 A100s):
//   build/examples/plan --layers 128 --hidden 25600 --heads 160 --batch 3072 --microbatch-size 1 \
//     --mesh batch=6,stage=64,model=8 --schedule bp,mp,pp:interleaved:2
#include <cstdio>
#include <iostream>

#include <partir/sim/json.hpp>

#include "cli.hpp"
#include "cluster_plan.hpp"

namespace p = partir;

namespace {

// A step that does not fit: each one-knob change (remat, more ZeRO on the batch axis, smaller microbatches)
// planned, and the fastest that fits named.
void suggest(const examples::ClusterPlan& c, const p::HardwareProfile& hw, const p::Report& now) {
  std::vector<std::pair<std::string, examples::ClusterPlan>> changes;
  if (c.remat.regions.empty()) {
    auto k = c;
    k.remat = p::Remat::blocks();
    changes.emplace_back("--remat blocks", k);
  }
  if (c.mesh.has_axis("batch") && c.schedule.find("z3") == std::string::npos)
    for (const char* zero : {"z2", "z3"}) {
      if (c.schedule.find(zero) != std::string::npos) continue;
      auto k = c;
      k.schedule += std::string(",") + zero;
      changes.emplace_back("--schedule " + k.schedule, k);
    }
  for (std::int64_t size = (c.microbatch_size > 0 ? c.microbatch_size : c.per_replica()) / 2; size >= 1; size /= 2) {
    if (!c.has_pipeline() && c.per_replica() / size > 8) break;  // unrolled: the program grows with the microbatches
    auto k = c;
    k.microbatch_size = size;
    changes.emplace_back("--microbatch-size " + std::to_string(size), k);
  }
  const std::string* best = nullptr;
  p::Report fastest;
  for (const auto& [flag, k] : changes) {
    const p::Report r = examples::plan_on_cluster(k, hw).report;
    if (r.fits() && (!best || r.step_seconds < fastest.step_seconds)) best = &flag, fastest = r;
  }
  if (!best) {
    std::printf("no one change of remat, ZeRO or microbatch size makes it fit\n");
    return;
  }
  std::printf("fits with %s: peak %s, step %s (%+.0f%%)\n", best->c_str(),
              p::human_bytes(static_cast<double>(fastest.peak_bytes)).c_str(), p::human_seconds(fastest.step_seconds).c_str(),
              100 * (fastest.step_seconds / now.step_seconds - 1));
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Predict a GPT train step on a cluster (time, MFU, memory, fit) without running it.", "plan");
  examples::ClusterPlan c{.model = {.vocab = 51200, .seq = 2048, .d_model = 2304, .heads = 24, .layers = 24}, .batch = 512};
  std::string mesh = "batch=32", profile = "a100-80gb-selene", precision = "bf16", remat = "blocks", report;
  app.add_option("--layers", c.model.layers, "transformer blocks")->check(cli::at_least(1));
  app.add_option("--hidden", c.model.d_model, "model width")->check(cli::at_least(1));
  app.add_option("--heads", c.model.heads, "attention heads")->check(cli::at_least(1));
  app.add_option("--seq", c.model.seq, "sequence length")->check(cli::at_least(1));
  app.add_option("--vocab", c.model.vocab, "vocabulary")->check(cli::at_least(1));
  app.add_option("--batch", c.batch, "sequences a step (global)")->check(cli::at_least(1));
  app.add_option("--microbatch-size", c.microbatch_size,
                 "sequences a microbatch on each data-parallel replica (0: all of them at once)")
      ->check(cli::at_least(0));
  app.add_option("--mesh", mesh, "device mesh, axes major to minor (batch, stage, model; the last inside a node)");
  app.add_option("--schedule", c.schedule, "tactics, as the training examples take them (bp, mp, z3, pp:interleaved:2, auto:model...)");
  app.add_option("--profile", profile, "a built-in hardware profile or a profile JSON file");
  app.add_option("--precision", precision, "compute dtype")->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--remat", remat, "activation recomputation")->check(CLI::IsMember({"none", "blocks"}));
  app.add_option("--report", report, "'json' prints the report as JSON")->check(CLI::IsMember({"json"}));
  app.parse(argc, argv);
  try {
    c.mesh = p::Mesh::parse(mesh);
    c.compute = precision == "bf16" ? p::DType::bf16 : p::DType::f32;
    c.remat = remat == "blocks" ? p::Remat::blocks() : p::Remat::none();
    bool builtin = false;
    for (const auto& name : p::HardwareProfile::builtin_names()) builtin |= name == profile;
    const p::HardwareProfile hw = builtin ? p::HardwareProfile::builtin(profile) : p::HardwareProfile::load(profile);
    const examples::Planned planned = examples::plan_on_cluster(c, hw);
    if (report == "json") {
      std::cout << planned.report.to_json().dump() << "\n";
      return 0;
    }
    std::cout << planned.report;
    std::printf("%d microbatch%s a step; planned in %.2f s (built, partitioned, lowered and simulated; nothing run)\n",
                planned.microbatches, planned.microbatches == 1 ? "" : "es", planned.seconds);
    if (!planned.report.fits()) suggest(c, hw, planned.report);
  } catch (const p::UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}

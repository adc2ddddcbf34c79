#pragma once
// A GPT train step planned for a cluster, nothing run: built with nn::Gpt at the given sizes, partitioned by a
// schedule on a mesh, lowered and simulated on a hardware profile. A pipelined step of M microbatches is built
// with 3 (4 where an interleaved schedule's 2 stages must divide them) and predicted by simulate_repeated, so
// hundreds of microbatches cost what 3 do; other steps are built with their microbatches. Used by examples/plan
// and bench/megatron_table.
#include <partir/partir.hpp>

#include <chrono>
#include <string>

namespace examples {

struct ClusterPlan {
  partir::nn::GptConfig model;
  std::int64_t batch = 8;            // sequences a step
  std::int64_t microbatch_size = 0;  // sequences a microbatch on each data-parallel replica (0: all at once)
  partir::Mesh mesh;
  std::string schedule = "bp";  // parse_schedule's text; bp on "batch", mp on "model", pp on "stage"
  partir::DType compute = partir::DType::bf16;
  partir::Remat remat = partir::Remat::blocks();

  std::int64_t replicas() const { return mesh.has_axis("batch") ? mesh.axis_size("batch") : 1; }  // data parallel
  std::int64_t per_replica() const { return batch / replicas(); }
  bool has_pipeline() const { return schedule.find("pp") != std::string::npos; }
};

struct Planned {
  partir::Report report;
  int microbatches = 1;
  double seconds = 0;  // to build, partition, lower and simulate
};

inline Planned plan_on_cluster(const ClusterPlan& c, const partir::HardwareProfile& hw) {
  namespace p = partir;
  const auto t0 = std::chrono::steady_clock::now();
  const int microbatches = c.microbatch_size > 0 ? static_cast<int>(c.per_replica() / c.microbatch_size) : 1;
  const bool pipelined = c.has_pipeline() && microbatches > 3;
  const std::int64_t stages = c.mesh.has_axis("stage") ? c.mesh.axis_size("stage") : 1;
  const bool interleaved = c.schedule.find("pp:interleaved:") != std::string::npos;
  const int built = !pipelined ? microbatches : interleaved && stages < 3 ? static_cast<int>(2 * stages) : 3;
  const std::int64_t batch = pipelined ? c.replicas() * c.microbatch_size * built : c.batch;
  const p::nn::Gpt model{c.model};
  p::StepOptions options{.remat = c.remat, .microbatches = built};
  if (c.compute != p::DType::f32) options.precision = p::MixedPrecision::with_compute(c.compute);
  const p::Program step = p::train_step([&](p::Tensor t, p::Tensor y) { return model.loss(t, y); }, p::Adam{1e-4},
                                        {{"tokens", {batch, c.model.seq}, p::DType::i32},
                                         {"targets", {batch, c.model.seq}, p::DType::i32}},
                                        options);
  const p::SpmdProgram spmd = p::lower(p::partition(step, c.mesh, p::parse_schedule(c.schedule)));
  Planned out{pipelined ? p::simulate_repeated(spmd, hw, microbatches, {.donate_state = true})
                        : p::simulate(spmd, hw, {.donate_state = true}),
              microbatches, 0};
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace examples

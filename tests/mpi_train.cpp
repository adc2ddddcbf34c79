// Run under mpirun: the MLP train step partitioned by a schedule, on the MPI backend, must give every rank
// the outputs the single-device interpreter computes, step after step (state carried as local shards), by
// execute() and by an Executable. With PRECISION bf16 or f16 (MixedPrecision) the single-device program is the
// same 16-bit program; partial sums rounded at other points allow a few 16-bit ulps (see test_transformer).
// With RECIPE "recipe", the step is AdamW with gradients clipped to a global norm and a learning rate fed
// each step (StepOptions): the clipping's norm is reduced across the ranks that split the gradients. With
// "remat", the backward pass recomputes the second layer (between the MLP's marks h1 and h2); with "accum",
// the batch runs as 2 microbatches (gradient accumulation); with "pp", also in 2 pipeline stages (1F1B) on the
// mesh's axis "stage", layers 1-2 on stage 0 and 3 on stage 1 (each device checks the outputs of its stage);
// with "pp:zb1", "pp:zbv" or "pp:interleaved:2" the same in that schedule, a 4-layer MLP in 4 microbatches
// (chunked schedules: one layer per virtual stage);
// with "bucket" (and "pp"), small all_reduces and reduce_scatters fused into buckets of at most 1 KiB.
// usage: mpi_train MESH SCHEDULE [PRECISION [RECIPE]]
#include <partir/partir.hpp>
#include <partir/runtime/comm/mpi.hpp>

#include <cmath>
#include <cstdio>

namespace p = partir;

int main(int argc, char** argv) {
  p::mpi::Session session(argc, argv);
  if (argc < 3 || argc > 5) {
    std::fprintf(stderr, "usage: mpi_train MESH SCHEDULE [PRECISION [RECIPE]]\n");
    return 2;
  }
  try {
    const p::MixedPrecision precision = p::MixedPrecision::parse(argc >= 4 ? argv[3] : "f32");
    const std::string variant = argc == 5 ? argv[4] : "";
    const bool recipe = variant == "recipe", remat = variant == "remat", pp = variant.starts_with("pp"),
               accum = variant == "accum" || pp, bucket = variant == "bucket" || pp;
    const p::PipelineSchedule pp_schedule = variant == "pp:zb1"             ? p::PipelineSchedule::zb1
                                            : variant == "pp:zbv"           ? p::PipelineSchedule::zbv
                                            : variant == "pp:interleaved:2" ? p::PipelineSchedule::interleaved(2)
                                                                            : p::PipelineSchedule::one_f_one_b;
    if (pp && variant != "pp" && pp_schedule == p::PipelineSchedule::one_f_one_b)
      throw p::UserError("RECIPE: unknown pipeline schedule '" + variant + "' (pp, pp:zb1, pp:zbv, pp:interleaved:2)");
    const bool chunked = pp_schedule.chunks > 1, split = pp_schedule != p::PipelineSchedule::one_f_one_b;
    if (argc == 5 && !recipe && !remat && !accum && !bucket)
      throw p::UserError("RECIPE: expected 'recipe', 'remat', 'accum', 'bucket' or 'pp', got '" + variant + "'");
    const double tolerance = precision.compute == p::DType::f32 ? 1e-5 : 3e-2;
    // Under "pp" the activation crossing the stages is 16 KiB per microbatch, past MPI's eager limit: sent in
    // place (SendsInPlace), its buffer must not be reused before the peer has it.
    p::nn::Mlp model{"params/mlp", split ? std::vector<std::int64_t>{8, 32, 512, 16, 8} : std::vector<std::int64_t>{8, 32, pp ? 512 : 16, 8}};
    auto loss = [&](p::Tensor x, p::Tensor y) { return p::mse(model(x), y); };
    const std::vector<p::InputSpec> data{{"x", {16, 8}}, {"y", {16, 8}}};
    const p::Program step = [&] {
      if (recipe)  // a norm the gradients exceed: clipped
        return p::train_step(loss, p::AdamW{.learning_rate = 1e-2, .weight_decay = 0.1}, data,
                             p::StepOptions{precision, 0.1, true});
      return p::train_step(loss, p::Adam{1e-2}, data,
                           p::StepOptions{.precision = precision,
                                          .remat = remat ? p::Remat{"layer 2", {{{"params/mlp/h1"}, {"params/mlp/h2"}}}}
                                                         : p::Remat::none(),
                                          .microbatches = split ? 4 : accum ? 2 : 1});
    }();
    if (remat && step.recomputes().empty()) throw p::UserError("remat: nothing is recomputed");
    const p::LRSchedule schedule = p::LRSchedule::warmup(2).then_cosine(2);
    auto lr_scale = [&](int s) { return p::Array({}, std::vector<double>{schedule.at(s)}); };
    p::Schedule tactics = p::parse_schedule(argv[2]);
    if (pp)
      tactics.insert(tactics.begin(),
                     p::pipeline("stage", pp_schedule,
                                 chunked ? std::vector<std::vector<std::string>>{{"params/mlp/*1"}, {"params/mlp/*2"}, {"params/mlp/*3"}, {"params/mlp/*4"}}
                                 : split ? std::vector<std::vector<std::string>>{{"params/mlp/*1", "params/mlp/*2"}, {"params/mlp/*3", "params/mlp/*4"}}
                                         : std::vector<std::vector<std::string>>{{"params/mlp/*1", "params/mlp/*2"}, {"params/mlp/*3"}}));
    // Buckets of at most 1 KiB: several per step on this small MLP.
    const p::SpmdProgram spmd = p::lower(p::partition(step, p::Mesh::parse(argv[1]), tactics), {.bucket_bytes = bucket ? 1024 : 0});
    if (bucket && !pp) {  // a plan without a bucket would test nothing new
      bool bucketed = false;
      for (const auto& c : spmd.collectives()) bucketed |= c.collective.reason.starts_with("bucket of");
      if (!bucketed) throw p::UserError("bucket: " + std::string(argv[2]) + " on " + argv[1] + " made no bucket");
    }
    p::mpi::Communicator comm;
    p::NamedArrays state = p::init_inputs(step, 3, true), local;
    for (const auto& b : spmd.inputs())
      local[b.name] = p::layout::shard(state.at(b.name), b.sharding, spmd.mesh(), comm.device());
    double worst = 0;
    for (int s = 0; s < 3; ++s) {
      if (recipe) state.insert_or_assign(p::StepOptions::lr_scale_name, lr_scale(s));
      if (recipe) local.insert_or_assign(p::StepOptions::lr_scale_name, lr_scale(s));
      p::NamedArrays expect = p::interpret(step, state);
      p::DeviceResult got = p::execute(spmd, comm, local, {.global_inputs = false, .global_outputs = false});
      for (const auto& b : spmd.outputs()) {
        if (!got.outputs.contains(b.name)) continue;  // another pipeline stage's state
        const p::Array want = p::layout::shard(expect.at(b.name), b.sharding, spmd.mesh(), comm.device());
        const p::Array& have = got.outputs.at(b.name);
        for (std::int64_t i = 0; i < want.size(); ++i)
          worst = std::max(worst, std::abs(want.at(i) - have.at(i)) / (1 + std::abs(want.at(i))));
      }
      p::carry_state(step, state, std::move(expect));
      for (const auto& o : step.outputs())
        if (!o.updates.empty() && got.outputs.contains(o.name)) local[o.updates] = std::move(got.outputs.at(o.name));
    }
    // The same three steps through an Executable (whole batch in, pieces of the state carried): its gathered
    // state must equal what the interpreter carried.
    const p::Executable exe(spmd, comm);
    p::NamedArrays pieces = exe.init(3), batch{{"x", state.at("x")}, {"y", state.at("y")}};
    for (int s = 0; s < 3; ++s) {
      if (recipe) batch.insert_or_assign(p::StepOptions::lr_scale_name, lr_scale(s));
      exe.step(pieces, batch);
    }
    for (const auto& [name, have] : exe.gather_state(pieces)) {
      const p::Array& want = state.at(name);
      for (std::int64_t i = 0; i < want.size(); ++i)
        worst = std::max(worst, std::abs(want.at(i) - have.at(i)) / (1 + std::abs(want.at(i))));
    }
    double all = 0;
    MPI_Allreduce(&worst, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (comm.device() == 0)
      std::printf("mpi_train %s %s %s%s: %zu collectives, max relative error %.3g over 3 steps\n", argv[1], argv[2],
                  std::string(p::name_of(precision.compute)).c_str(), variant.empty() ? "" : (" " + variant).c_str(), spmd.collectives().size(), all);
    return all < tolerance ? 0 : 1;
  } catch (const p::UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

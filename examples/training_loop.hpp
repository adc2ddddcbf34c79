#pragma once
// The examples' shared SPMD training loop: every device (a thread or an MPI rank) runs this function with its
// own communicator, holds only its shards of the parameters and optimizer state, feeds its piece of each
// global batch, and carries the updated shards to the next step. Device 0 prints and writes the report.
#include <partir/partir.hpp>
#include <partir/runtime/state/checkpoint.hpp>
#include <partir/runtime/state/safetensors.hpp>
#include <partir/sim/json.hpp>
#ifdef PARTIR_EXAMPLES_MPI
#include <partir/runtime/comm/mpi.hpp>
#endif
#ifdef PARTIR_EXAMPLES_NCCL  // Executable::step then runs nccl::Communicator programs on the GPU executor
#include <partir/runtime/gpu/executor.hpp>
#include <partir/calibrate/gpu_profile.hpp>
#ifdef PARTIR_EXAMPLES_MPI
#include <partir/runtime/comm/nccl_mpi.hpp>
#endif
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <unistd.h>

#include "cli.hpp"
#include "plot.hpp"
#include "recipe.hpp"

namespace examples {

namespace p = partir;

// --checkpoint DIR [--checkpoint-every N] [--resume]: save the sharded training state every N steps and at
// the end; with --resume, continue from the latest checkpoint in DIR (onto any mesh and schedule).
// --load-safetensors DIR starts from the weights in DIR (optimizer state fresh; a checkpoint resumed wins);
// --save-safetensors DIR writes the trained weights there after the last step (runtime/state/safetensors.hpp).
struct CheckpointOptions {
  std::string dir;  // "" = no checkpoints
  long every = 0;   // 0 = only after the last step
  bool resume = false;
  std::string load_safetensors, save_safetensors;  // "" = none
  double safetensors_shard_mb = 5000;               // files of at most this many MB (10^6 bytes)
};

// Where an example runs and what it keeps: --mesh, --schedule, --backend, --report, --report-file and the
// checkpoint flags, declared on `app` before it parses.
struct RunFlags {
  std::string mesh, schedule, backend = "threads", report, report_file;
  CheckpointOptions checkpoint;

  RunFlags(CLI::App& app, std::string mesh_default, std::string schedule_default, const std::string& schedule_help,
           std::string report_default)
      : mesh(std::move(mesh_default)), schedule(std::move(schedule_default)), report_file(std::move(report_default)) {
    app.add_option("--mesh", mesh, "device mesh, axes major to minor (e.g. batch=2,model=2)");
    app.add_option("--schedule", schedule, schedule_help);
    app.add_option("--backend", backend, "threads (one process), mpi (under mpirun) or nccl (one GPU per device)")
        ->check(CLI::IsMember({"threads", "mpi", "nccl"}));
    app.add_option("--report", report, "'json' writes a JSON report of the run")->check(CLI::IsMember({"json"}));
    app.add_option("--report-file", report_file, "where --report json writes");
    app.add_option("--checkpoint", checkpoint.dir, "directory for sharded checkpoints of the training state");
    app.add_option("--checkpoint-every", checkpoint.every, "save every N steps (0: after the last step only)")
        ->check(cli::at_least(0));
    app.add_flag("--resume", checkpoint.resume, "continue from the latest checkpoint in --checkpoint DIR");
    app.add_option("--load-safetensors", checkpoint.load_safetensors,
                   "start from the weights in this directory or .safetensors file (saved on any mesh, or by PyTorch)");
    app.add_option("--save-safetensors", checkpoint.save_safetensors,
                   "write the trained weights to this directory as safetensors (Hugging Face's names for llama_train)");
    app.add_option("--safetensors-shard-mb", checkpoint.safetensors_shard_mb,
                   "--save-safetensors splits the weights into files of at most this many MB, listed by "
                   "model.safetensors.index.json (transformers' max_shard_size)")
        ->check(CLI::PositiveNumber);
  }
  std::string report_path() const { return report == "json" ? report_file : ""; }
};

// How the training loop reports and computes: --log-every, --plot, --profile, --precision, --bucket-mb,
// --prefetch-mb.
struct LoopFlags {
  long log_every = 0;
  std::string plot_dir, profile = "auto", precision = "f32";
  double bucket_mb = 25;
  double prefetch_mb = -1;

  explicit LoopFlags(CLI::App& app) {
    app.add_option("--log-every", log_every, "a progress line every N steps (0: every step up to 20 steps, else steps/10)")
        ->check(cli::at_least(0));
    app.add_option("--plot", plot_dir, "directory for loss.svg and memory.svg (predicted vs measured per device)");
    app.add_option("--profile", profile, "the simulator's hardware: auto ($PARTIR_PROFILE, else this machine's calibration, "
                                         "cached), calibrate (measure again), cpu, h100-nvlink, ... or a JSON file");
    app.add_option("--precision", precision, "compute dtype: f32, bf16 or f16 (f32 master weights)")
        ->check(CLI::IsMember({"f32", "bf16", "f16"}));
    app.add_option("--bucket-mb", bucket_mb, "fuse smaller gradient all_reduces, ZeRO reduce_scatters and ZeRO-3 all_gathers into buckets of this many MiB, as DDP and FSDP (0: off)")
        ->check(CLI::Range(0.0, 1024.0));
    app.add_option("--prefetch-mb", prefetch_mb, "extra MiB that collectives moved early may hold, ZeRO-3's gathers "
                                                 "ahead of their layer (-1: one collective ahead)")
        ->check(CLI::Range(-1.0, 65536.0));
  }
  p::LowerOptions lower_options() const {
    return {.bucket_bytes = static_cast<std::int64_t>(bucket_mb * (1 << 20)),
            .prefetch_bytes = prefetch_mb < 0 ? p::one_collective_ahead : static_cast<std::int64_t>(prefetch_mb * (1 << 20))};
  }
  long log_every_for(long steps) const { return log_every > 0 ? log_every : steps <= 20 ? 1 : std::max(1L, steps / 10); }
  p::MixedPrecision mixed_precision() const { return p::MixedPrecision::parse(precision, "--precision"); }
};

struct LoopOptions {
  long steps = 100;
  std::uint64_t seed = 0;
  long tokens_per_step = 0;  // for tokens/s (examples per step for non-sequence models)
  std::string report_file;   // "" = no report
  std::string label;         // mesh, schedule and backend, for the report
  CheckpointOptions checkpoint = {};
  long log_every = 1;        // a progress line every N steps (and after the last); on a terminal, a live line between
  Recipe recipe = {};        // feeds each step's learning-rate scale; the progress line shows the rate
  // Every validate_every steps (and after the last), every device calls validate(state) and device 0 prints
  // and reports the loss it returns (a held-out set through a forward-only program).
  long validate_every = 0;
  std::function<double(const p::NamedArrays& state)> validate = {};
  // Called on device 0 after the last step of a run that started at step 1, with the trained state made
  // whole and the last loss: the example checks them against the single-device program.
  std::function<void(const p::NamedArrays& trained, double loss)> check_single_device = {};
  std::string plot_dir = {};  // "" = no pictures
  std::string profile = "auto";
};

// The options every example takes from its flags alike; `example` names it in the report's label.
inline LoopOptions loop_options(const std::string& example, const RunFlags& run, const LoopFlags& loop,
                                const Recipe& recipe, const p::Mesh& mesh, long steps, long seed, long tokens_per_step) {
  LoopOptions o{steps, static_cast<std::uint64_t>(seed), tokens_per_step, run.report_path(),
                example + " mesh " + mesh.to_string() + " schedule " + run.schedule + " backend " + run.backend +
                    " precision " + std::string(name_of(loop.mixed_precision().compute)),
                run.checkpoint, loop.log_every_for(steps), recipe};
  o.plot_dir = loop.plot_dir;
  o.profile = loop.profile;
  return o;
}

// The --profile the prediction uses. auto: $PARTIR_PROFILE, else this machine's cached calibration (CPU
// backends; a GPU backend takes its GPU's datasheet profile).
template <p::Communicator C>
p::HardwareProfile profile_for(C& comm, const std::string& choice) {
  const char* env = std::getenv("PARTIR_PROFILE");
  if (choice == "auto" && env && *env) return p::HardwareProfile::detect();
#ifdef PARTIR_EXAMPLES_NCCL
  if constexpr (requires { comm.gpu(); })
    if (choice == "auto") return p::gpu::datasheet_profile(comm.gpu());
#endif
  if (choice != "auto" && choice != "calibrate") return p::HardwareProfile::named(choice);
  const bool refresh = choice == "calibrate";
  if (comm.device() == 0 && (refresh || !std::filesystem::exists(p::machine_profile_path(comm))))
    std::cout << "calibrating the simulator on this machine (a few seconds, once; cached in "
              << p::machine_profile_path(comm).string() << ")" << std::endl;
  return p::machine_profile(comm, refresh);
}

// Makes the global data inputs of step `s` (identical on every device: same seed, same step).
using BatchFn = std::function<p::NamedArrays(long s)>;

// The plan's collectives as report entries: kind, axes, dim, bytes and the reason.
inline p::json::Value collectives_json(const p::SpmdProgram& spmd) {
  p::json::Value out = p::json::Value::array();
  for (const auto& c : spmd.collectives())
    out.push_back({{"kind", p::name_of(c.collective.kind)}, {"axes", p::to_string(c.collective.axes)},
                   {"dim", c.collective.dim}, {"bytes", c.bytes}, {"reason", c.collective.reason}});
  return out;
}

// --plot DIR: loss.svg (training loss per step, validation points) and memory.svg (per device, the predicted
// peak stacked by kind next to the measured peak).
inline void plot_run(const std::string& dir, const std::string& label, long first, const std::vector<double>& losses,
                     const std::vector<long>& validated_at, const std::vector<double>& validation,
                     const p::SpmdProgram& spmd, const p::Report& predicted, const std::vector<double>& measured) try {
  std::filesystem::create_directories(dir);
  plot::Series train{"training loss", "#1f77b4", {}}, held_out{"validation loss", "#d62728", {}, true};
  for (std::size_t i = 0; i < losses.size(); ++i) train.points.emplace_back(first + static_cast<long>(i), losses[i]);
  for (std::size_t i = 0; i < validation.size(); ++i) held_out.points.emplace_back(validated_at[i], validation[i]);
  plot::line_chart(std::filesystem::path(dir) / "loss.svg", "training loss", label, "step", "loss",
                   held_out.points.empty() ? std::vector{train} : std::vector{train, held_out});
  static const char* colors[] = {"#1f77b4", "#aec7e8", "#ff7f0e", "#7f7f7f", "#2ca02c", "#d62728", "#9467bd"};
  constexpr double MiB = 1 << 20;
  std::vector<plot::Bar> bars;
  for (std::size_t d = 0; d < measured.size(); ++d) {
    const int stage = spmd.stage_of(static_cast<std::int64_t>(d));
    const p::MemoryBreakdown& peak = predicted.stages.empty() ? predicted.peak : predicted.stages[static_cast<std::size_t>(stage)].peak;
    plot::Bar bar{"d" + std::to_string(d) + " sim", {}};
    for (std::size_t k = 0; k < peak.bytes.size(); ++k)
      if (peak.bytes[k] > 0)
        bar.segments.emplace_back(std::string(p::name_of(p::MemoryKind(k))), static_cast<double>(peak.bytes[k]) / MiB, colors[k % 7]);
    bars.push_back(std::move(bar));
    bars.push_back({"d" + std::to_string(d) + " run", {{"measured peak", measured[d] / MiB, "#333333"}}});
  }
  plot::bar_chart(std::filesystem::path(dir) / "memory.svg", "peak memory per device: predicted (sim) vs measured (run)",
                  label, "MiB", bars);
} catch (const std::exception& e) {  // an unwritable directory: the same one line as any bad input
  p::user_error(std::string("--plot ") + dir + ": " + e.what());
}

// What a run ends with: the last loss, and this device's pieces of the trained state (parameters and
// optimizer state, as the SPMD program lays them out; Executable::gather_state makes them whole).
struct Trained {
  double loss = 0;
  p::NamedArrays state;
};

template <p::Communicator C>
Trained train(const p::Executable<C>& exe, const BatchFn& next_batch, const LoopOptions& o) {
  C& comm = exe.communicator();
  const p::SpmdProgram& spmd = exe.spmd();
  const bool lead = comm.device() == 0;
  p::NamedArrays state = exe.init(o.seed);
  // The simulator's prediction for this plan, checked against what the run measures at the end.
  const p::HardwareProfile profile = profile_for(comm, o.profile);
  p::tune_collectives(comm, profile);  // MPI: all_reduce by the algorithm this machine measured faster
  const p::Report predicted = p::simulate(spmd, profile, {.donate_state = true});  // as Executable::step runs it
  if (lead)
    std::cout << "predicted (profile " << profile.name << ", --profile picks another): step "
              << p::human_seconds(predicted.step_seconds) << ", peak "
              << p::human_bytes(static_cast<double>(predicted.peak_bytes)) << " per device"
              << (predicted.fits() ? "" : " (DOES NOT FIT in " + p::human_bytes(static_cast<double>(predicted.memory_capacity)) + ")")
              << (predicted.stages.empty() ? "" : ", pipeline bubble " + std::to_string(static_cast<int>(
                                                      100 * predicted.bubble_fraction + 0.5)) + "%")
              << ", MFU " << std::setprecision(3) << 100 * predicted.mfu() << "%" << std::endl;
  std::vector<double> step_ms, gpu_ms;  // gpu_ms: the GPU executor's ops alone, without host<->GPU copies
  std::int64_t peak = 0;
  double loss = 0;
  long first = 1;
  const auto& ck = o.checkpoint;
  if (!ck.load_safetensors.empty()) {
    p::restore_safetensors(ck.load_safetensors, spmd, comm, state);
    if (lead) std::cout << "weights from " << ck.load_safetensors << std::endl;
  }
  if (ck.resume) {
    if (ck.dir.empty()) p::user_error("--resume needs --checkpoint DIR");
    if (p::checkpoint::exists(ck.dir)) {
      first = p::checkpoint::restore(ck.dir, spmd, comm, state) + 1;
      if (lead) std::cout << "resumed from " << ck.dir << " at step " << first - 1 << std::endl;
      if (first > o.steps)
        p::user_error("--resume: the checkpoint in " + ck.dir + " is at step " + std::to_string(first - 1) +
                      ", nothing left to run for --steps " + std::to_string(o.steps));
    } else if (lead) {
      std::cout << "no checkpoint in " << ck.dir << ": starting at step 1" << std::endl;
    }
  }
  const bool live = lead && isatty(STDOUT_FILENO);  // a line redrawn each step, as progress bars do
  const auto started = std::chrono::steady_clock::now();
  auto drawn = started - std::chrono::seconds(1);
  std::vector<double> losses, validation;
  std::vector<long> validated_at;
  for (long s = first; s <= o.steps; ++s) {
    p::NamedArrays batch = next_batch(s);
    batch.merge(o.recipe.step_inputs(s));
    comm.barrier();  // time the step, not the previous step's stragglers
    const auto t0 = std::chrono::steady_clock::now();
    const p::DeviceResult r = exe.step(state, batch);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    step_ms.push_back(ms);
    if (r.gpu_seconds > 0) gpu_ms.push_back(r.gpu_seconds * 1e3);
    peak = std::max(peak, r.peak_bytes);
    loss = r.outputs.at("loss").at(0);
    losses.push_back(loss);
    const auto norm = r.outputs.find("grad_norm");
    if (!ck.dir.empty() && (s == o.steps || (ck.every > 0 && s % ck.every == 0)))
      p::checkpoint::save(ck.dir, spmd, comm, state, s);
    const bool logged = s % std::max(1L, o.log_every) == 0 || s == o.steps;
    if (live && !logged && std::chrono::steady_clock::now() - drawn > std::chrono::milliseconds(100)) {  // <= 10 Hz
      drawn = std::chrono::steady_clock::now();
      const double elapsed = std::chrono::duration<double>(drawn - started).count();
      const double eta = elapsed / static_cast<double>(s - first + 1) * static_cast<double>(o.steps - s);
      std::cout << "\r\033[K"  // back to the line's start, clear it
                << "step " << s << "/" << o.steps << "  loss " << std::setprecision(6) << loss << "  "
                << std::setprecision(4) << ms << " ms  " << o.tokens_per_step / (ms / 1e3) << " tokens/s  ETA "
                << std::setprecision(3) << eta << " s" << std::flush;
    }
    if (lead && logged) {
      std::cout << (live ? "\r\033[K" : "") << "step " << s << " loss " << std::setprecision(6) << loss << " lr "
                << std::setprecision(3) << o.recipe.learning_rate(s);
      if (norm != r.outputs.end()) std::cout << " grad_norm " << std::setprecision(4) << norm->second.at(0);
      std::cout << " ms " << std::setprecision(4) << ms << " tokens/s " << std::setprecision(4)
                << o.tokens_per_step / (ms / 1e3) << std::endl;
    }
    if (o.validate && (s == o.steps || (o.validate_every > 0 && s % o.validate_every == 0))) {
      validation.push_back(o.validate(state));
      validated_at.push_back(s);
      if (lead) std::cout << "step " << s << " validation loss " << std::setprecision(6) << validation.back() << std::endl;
    }
  }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!ck.save_safetensors.empty()) {
    p::save_safetensors(ck.save_safetensors, spmd, comm, state,
                        {.max_file_bytes = static_cast<std::int64_t>(ck.safetensors_shard_mb * 1e6)});
    if (lead) std::cout << "weights saved in " << ck.save_safetensors << std::endl;
  }
  if (o.check_single_device && first == 1) {
    const p::NamedArrays trained = exe.gather_state(state);  // a collective: every device takes part
    if (lead) o.check_single_device(trained, loss);
  }
  // Every device's peak, gathered to all (doubles: collectives carry float types).
  const auto n = comm.num_devices();
  p::Group all;
  for (int d = 0; d < n; ++d) all.devices.push_back(d);
  std::vector<double> peaks(static_cast<std::size_t>(n));
  const double mine = static_cast<double>(peak);
  comm.all_gather(all, &mine, peaks.data(), 1, p::DType::f64);
  if (lead) {
    std::cout << "final loss " << std::setprecision(6) << loss << " after " << step_ms.size() << " steps in "
              << p::human_seconds(total_s) << std::endl;
    // The median step: the first steps also fault in fresh buffers, which the simulator does not model.
    std::vector<double> sorted = step_ms;
    std::sort(sorted.begin(), sorted.end());
    const double median_ms = sorted.empty() ? 0 : sorted[sorted.size() / 2];
    const double measured_peak = *std::max_element(peaks.begin(), peaks.end());
    if (median_ms > 0)
      std::cout << "measured: step " << p::human_seconds(median_ms / 1e3) << " (median of " << sorted.size()
                << "), MFU " << std::setprecision(3)
                << (predicted.peak_flops > 0 ? 100 * predicted.model_flops / (median_ms / 1e3 * predicted.peak_flops) : 0)
                << "% (of " << static_cast<long long>(predicted.peak_flops / 1e9) << " GFLOP/s, " << p::name_of(predicted.flops_dtype)
                << "), peak "
                << p::human_bytes(measured_peak) << " (largest device); predicted/measured: time "
                << std::setprecision(3) << predicted.step_seconds * 1e3 / median_ms << ", memory "
                << static_cast<double>(predicted.peak_bytes) / measured_peak << std::endl;
    if (!gpu_ms.empty()) {
      std::sort(gpu_ms.begin(), gpu_ms.end());
      std::cout << "gpu: ops " << p::human_seconds(gpu_ms[gpu_ms.size() / 2] / 1e3)
                << " (median); the rest of each step copies its inputs and outputs between host and GPU" << std::endl;
    }
    if (!o.report_file.empty()) {
      std::vector<double> rates;
      for (long s = first; s <= o.steps; ++s) rates.push_back(o.recipe.learning_rate(s));
      p::json::Value validations = p::json::Value::array(), collectives = collectives_json(spmd);
      for (std::size_t i = 0; i < validation.size(); ++i)
        validations.push_back({{"step", validated_at[i]}, {"loss", validation[i]}});
      std::vector<std::int64_t> peak_bytes(peaks.begin(), peaks.end());
      p::json::write_file(o.report_file,
                          {{"run", o.label}, {"final_loss", loss}, {"step_ms", step_ms}, {"first_step", first},
                           {"train_loss", losses}, {"learning_rate", rates}, {"validation", validations},
                           {"peak_bytes_per_device", peak_bytes},
                           {"predicted", {{"profile", profile.name}, {"step_ms", predicted.step_seconds * 1e3},
                                          {"peak_bytes", predicted.peak_bytes}, {"fits", predicted.fits()},
                                          {"model_flops_per_device", predicted.model_flops}, {"mfu", predicted.mfu()}}},
                           {"collectives", collectives}});
      std::cout << "report written to " << o.report_file << std::endl;
    }
    if (!o.plot_dir.empty()) {
      plot_run(o.plot_dir, o.label, first, losses, validated_at, validation, spmd, predicted, peaks);
      std::cout << "plots written to " << o.plot_dir << "/loss.svg and memory.svg" << std::endl;
    }
  }
  return {loss, std::move(state)};
}

// The pieces of `state` (a state of `from`) that `to` reads: as they are where both programs lay an array
// out alike, else gathered whole and cut again (a collective; every device takes the same branch).
template <p::Communicator C>
p::NamedArrays state_for(const p::Executable<C>& to, const p::Executable<C>& from, const p::NamedArrays& state) {
  p::NamedArrays out;
  for (const auto& b : to.spmd().inputs()) {
    if (!p::is_state(to.spmd(), b)) continue;
    const auto& theirs = from.spmd().inputs();
    const auto it = std::find_if(theirs.begin(), theirs.end(), [&](const auto& t) { return t.name == b.name; });
    if (it == theirs.end() || it->sharding != b.sharding ||
        to.spmd().op(b.value).stage != from.spmd().op(it->value).stage)  // pipeline stages hold their own
      return to.shard_state(from.gather_state(state));
    if (state.contains(b.name)) out[b.name] = state.at(b.name);
  }
  return out;
}

// A --schedule without one of its tactics ("bp,z2" without z2: "bp").
inline std::string without_tactic(const std::string& schedule, const std::string& tactic) {
  std::string out;
  std::size_t start = 0;
  while (start <= schedule.size()) {
    const auto end = std::min(schedule.find(',', start), schedule.size());
    const std::string item = schedule.substr(start, end - start);
    if (item != tactic) out += (out.empty() ? "" : ",") + item;
    start = end + 1;
  }
  return out.empty() ? "none" : out;
}

// This process's MPI rank when a launcher started it (mpirun sets OMPI_COMM_WORLD_RANK; srun --mpi=pmix and
// other PMIx launchers PMIX_RANK; PMI-1/2 launchers PMI_RANK), else nullptr.
inline const char* launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* rank = std::getenv(name)) return rank;
  return nullptr;
}

// Whether this process prints what every process computes alike: not an MPI rank other than 0.
inline bool lead_process() {
  const char* rank = launcher_rank();
  return !rank || std::string(rank) == "0";
}

// partition() with a --schedule, printing what each automatic tactic (auto:<axis>) chose and why. Once per
// run: MPI ranks other than 0 (every rank searches, deterministically, to the same plan) stay quiet.
inline p::Partitioned partition_and_report(const p::Program& step, const p::Mesh& mesh, const p::Schedule& schedule) {
  p::Partitioned plan = p::partition(step, mesh, schedule);
  if (lead_process())
    for (const auto& t : schedule)
      if (const auto* a = t.as<p::AutomaticPartition>(); a && a->report) std::cout << *a->report << std::flush;
  return plan;
}

// Runs fn(communicator) on every device of the chosen backend: `devices` threads of this process, or this
// MPI rank (under mpirun, one rank per device); nccl: one GPU per device, as threads of this process, or
// as MPI ranks when started by mpirun.
template <class Fn>
void run_on_backend(const std::string& backend, std::int64_t devices, int& argc, char**& argv, Fn&& fn) {
  if (backend == "threads") {
    p::threads::run(static_cast<int>(devices), [&](p::threads::Communicator& c) { fn(c); });
  } else if (backend == "mpi") {
#ifdef PARTIR_EXAMPLES_MPI
    p::mpi::Session session(argc, argv);
    if (session.rank() == 0) {
      char host[256] = "?";
      gethostname(host, sizeof host - 1);
      std::cout << "mpi: " << session.size() << " ranks, " << session.ranks_on_this_host() << " on this host (" << host
                << "), " << p::kernel_threads() << " kernel threads per rank" << std::endl;
    }
    p::mpi::abort_on_error([&] {  // one rank's error must end every rank, not leave them in a collective
      p::mpi::Communicator c;
      fn(c);
    });
#else
    (void)argc, (void)argv;
    p::user_error("--backend mpi: this build has no MPI (configure with -Dmpi=enabled)");
#endif
  } else if (backend == "nccl") {
#ifdef PARTIR_EXAMPLES_NCCL
#ifdef PARTIR_EXAMPLES_MPI
    if (launcher_rank()) {
      p::mpi::Session session(argc, argv);
      auto c = p::nccl::from_mpi();
      fn(*c);
      return;
    }
#endif
    (void)argc, (void)argv;
    p::nccl::run(static_cast<int>(devices), [&](p::nccl::Communicator& c) { fn(c); });
#else
    (void)argc, (void)argv;
    p::user_error("--backend nccl: this build has no NCCL backend (configure with -Dnccl=enabled; needs CUDA and NCCL "
                  "under CUDA_HOME)");
#endif
  } else {
    p::user_error("--backend: expected threads, mpi or nccl, got '" + backend + "'");
  }
}

#ifndef PARTIR_EXAMPLES_LIBRARY
// Compiled once, in training_loop.cpp (library examples_common), for each backend the build has.
extern template Trained train(const p::Executable<p::threads::Communicator>&, const BatchFn&, const LoopOptions&);
#ifdef PARTIR_EXAMPLES_MPI
extern template Trained train(const p::Executable<p::mpi::Communicator>&, const BatchFn&, const LoopOptions&);
#endif
#ifdef PARTIR_EXAMPLES_NCCL
extern template Trained train(const p::Executable<p::nccl::Communicator>&, const BatchFn&, const LoopOptions&);
#endif
#endif

}  // namespace examples

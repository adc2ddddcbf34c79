// Predicted vs measured: the MLP train step (Adam, f32) under several strategies, each lowered, simulated
// and executed; prints step time and peak memory side by side with relative errors and the Spearman rank
// correlation across all configurations (targets: rank correlation 1.0, time within 15%, memory within 5%).
//   simulator_accuracy [--backend threads|mpi] [--devices 2,4] [--batch 256] [--sizes 1024,4096,1024]
//                      [--reps 5] [--profile calibrate|cpu|file.json] [--json out.json] [--trace-dir dir]
// threads: every device count in --devices, one process; mpi: the world size (mpirun -np 2 ...).
// --profile calibrate (the default) measures this machine first with the same devices (calibrate/calibrate.hpp).
// Measured time: the slowest device's execute() per step, the best of --reps steps (calibration also keeps
// its best rounds: on a shared machine other work only ever adds time); measured memory: the executor's peak
// (each device is given only its own piece of every input). Steps run as a training loop runs them
// (Executable::step): each donates the state its outputs replace and takes the new state for the next, and
// the simulator predicts that (SimulateOptions::donate_state). Kept inputs would make every update write fresh
// buffers, whose first touch (page faults, ~3x the update's own time here) no profile models.
// --trace-dir: per configuration, the simulated timeline (<N>-<strategy>.sim.json) and each device's measured
// one (<N>-<strategy>.measured.<device>.json) as Chrome trace JSON, to open side by side in ui.perfetto.dev.
#include <partir/partir.hpp>
#include <partir/calibrate/trace.hpp>
#ifdef PARTIR_BENCH_MPI
#include <partir/runtime/comm/mpi.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>

#include "../examples/cli.hpp"

namespace p = partir;

namespace {

struct Options {
  std::string backend = "threads";
  std::vector<std::int64_t> devices = {2, 4};
  std::int64_t batch = 256;
  std::vector<std::int64_t> sizes = {1024, 4096, 1024};
  int reps = 5;
  std::string profile = "calibrate", json_path, trace_dir;
};

[[noreturn]] void fail(const std::string& why) {
  std::cerr << "error: " << why << " (see --help)\n";
  std::exit(2);
}

std::vector<std::int64_t> parse_list(const std::string& flag, const std::string& s) {
  std::vector<std::int64_t> out;
  std::size_t start = 0;
  while (start <= s.size()) {
    const auto end = std::min(s.find(',', start), s.size());
    char* stop = nullptr;
    const std::string item = s.substr(start, end - start);
    out.push_back(std::strtoll(item.c_str(), &stop, 10));
    if (item.empty() || *stop || out.back() < 1) fail(flag + ": expected positive integers separated by commas, got '" + s + "'");
    start = end + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  std::string devices = "2,4", sizes = "1024,4096,1024";
  cli::App app("The simulator's predicted step time and memory against measured ones, per strategy.", "simulator_accuracy");
  app.add_option("--backend", o.backend, "threads or mpi (under mpirun)")->check(CLI::IsMember({"threads", "mpi"}));
  app.add_option("--devices", devices, "device counts (threads backend), comma-separated");
  app.add_option("--batch", o.batch, "examples per step")->check(cli::at_least(1));
  app.add_option("--sizes", sizes, "the MLP's layer widths, input first");
  app.add_option("--reps", o.reps, "timed steps per configuration")->check(cli::at_least(1));
  app.add_option("--profile", o.profile, "calibrate (measure first), a built-in profile name, or a profile JSON file");
  app.add_option("--json", o.json_path, "also write the rows as JSON");
  app.add_option("--trace-dir", o.trace_dir, "simulated and measured timelines as Chrome trace JSON");
  app.parse(argc, argv);
  o.devices = parse_list("--devices", devices);
  o.sizes = parse_list("--sizes", sizes);
  if (o.sizes.size() < 2) fail("--sizes needs at least {in, out}");
  return o;
}

struct Strategy {
  std::string name;  // as the examples' --schedule spells it
  p::Mesh mesh;
};

// none, bp, mp, bp+z2, bp+z3 on n devices, and bp+mp when both axes can have 2 or more devices.
std::vector<Strategy> strategies(std::int64_t n) {
  std::vector<Strategy> out = {{"none", p::Mesh{{"batch", n}}},
                               {"bp", p::Mesh{{"batch", n}}},
                               {"mp", p::Mesh{{"model", n}}},
                               {"bp,z2", p::Mesh{{"batch", n}}},
                               {"bp,z3", p::Mesh{{"batch", n}}}};
  if (n >= 4 && n % 2 == 0) out.insert(out.begin() + 3, {"bp,mp", p::Mesh{{"batch", 2}, {"model", n / 2}}});
  return out;
}

struct Measured {
  double seconds = 0;                // the best step, slowest device
  double communication_seconds = 0;  // in collectives during that step, slowest device
  std::int64_t peak_bytes = 0;       // the largest device peak
  std::vector<p::OpTiming> timeline;  // this device's ops during that step
};

struct Result {
  std::int64_t devices;
  std::string strategy, mesh;
  p::Report predicted;
  Measured measured;
};

// One configuration on this device: every device runs the same steps; the slowest device times a step.
template <p::Communicator C>
Measured measure(C& comm, const p::SpmdProgram& spmd, const p::NamedArrays& global, int reps) {
  p::NamedArrays local;
  for (const auto& b : spmd.inputs())
    local[b.name] = p::layout::shard(global.at(b.name), b.sharding, spmd.mesh(), comm.device());
  const p::ExecuteOptions pieces{.global_inputs = false, .global_outputs = false, .timeline = true, .donate = &local};
  auto step = [&] {
    p::DeviceResult result = p::execute(spmd, comm, local, pieces);
    for (const auto& o : spmd.outputs())
      if (!o.updates.empty()) local[o.updates] = std::move(result.outputs.at(o.name));
    return result;
  };
  const std::int64_t peak = step().peak_bytes;  // also the warm-up
  Measured best{std::numeric_limits<double>::infinity(), 0, 0, {}};
  for (int r = 0; r < reps; ++r) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    const auto result = step();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double in_collectives = 0;
    for (double c : result.collective_seconds) in_collectives += c;
    const double step = p::calibration::max_over_devices(comm, seconds);
    const double communication = p::calibration::max_over_devices(comm, in_collectives);
    if (step < best.seconds) best = {step, communication, 0, result.timeline};
  }
  best.peak_bytes = static_cast<std::int64_t>(p::calibration::max_over_devices(comm, static_cast<double>(peak)));
  return best;
}

// Every strategy on the devices of `comm`; device 0 appends the results.
template <p::Communicator C>
void run_device_count(C& comm, const Options& o, const p::Program& step, const p::NamedArrays& global,
                      std::vector<Result>& results) {
  const std::int64_t n = comm.num_devices();
  p::HardwareProfile hw;
  if (o.profile == "calibrate") {
    p::CalibrationOptions co;
    co.name = "calibrated-" + o.backend + "-" + std::to_string(n);
    hw = p::calibrate(comm, co);
  } else {
    hw = p::HardwareProfile::named(o.profile);
  }
  for (const auto& s : strategies(n)) {
    const p::SpmdProgram spmd = p::lower(p::partition(step, s.mesh, p::parse_schedule(s.name == "none" ? "" : s.name)));
    const Measured m = measure(comm, spmd, global, o.reps);
    const std::string trace = o.trace_dir + "/" + std::to_string(n) + "-" + s.name;
    if (!o.trace_dir.empty())
      p::json::write_file(trace + ".measured." + std::to_string(comm.device()) + ".json",
                          p::chrome_trace(p::trace_events(spmd, m.timeline, comm.device()), "measured " + spmd.name()));
    if (comm.device() != 0) continue;
    results.push_back({n, s.name, s.mesh.to_string(), p::simulate(spmd, hw, {.donate_state = true}), m});
    if (!o.trace_dir.empty())
      p::json::write_file(trace + ".sim.json",
                          p::chrome_trace(results.back().predicted, n));
  }
}

// Ranks with ties sharing their mean rank, then Pearson's correlation of the ranks.
double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  auto ranks = [](const std::vector<double>& x) {
    std::vector<double> r(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      double less = 0, equal = 0;
      for (double y : x) less += y < x[i], equal += y == x[i];
      r[i] = less + (equal + 1) / 2;
    }
    return r;
  };
  const auto ra = ranks(a), rb = ranks(b);
  const double n = static_cast<double>(a.size()), mean = (n + 1) / 2;
  double cov = 0, va = 0, vb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    cov += (ra[i] - mean) * (rb[i] - mean);
    va += (ra[i] - mean) * (ra[i] - mean);
    vb += (rb[i] - mean) * (rb[i] - mean);
  }
  return va > 0 && vb > 0 ? cov / std::sqrt(va * vb) : 1.0;
}

// The host's 1-minute load average ("" where /proc has none): other work on a shared machine skews both
// calibration and measurement, so the figures travel with it.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one;
}

void report(const std::vector<Result>& results, const Options& o, const std::string& model, const std::string& load) {
  std::printf("# simulator accuracy: %s, backend %s, profile %s\n", model.c_str(), o.backend.c_str(), o.profile.c_str());
  if (!load.empty()) std::printf("# host load average: %s at start, %s at end\n", load.c_str(), load_average().c_str());
  const std::string time_model =
      p::async_collectives_enabled()
          ? "compute and communication on two streams (collectives of " +
                p::human_bytes(static_cast<double>(p::stream_min_bytes())) + " and more streamed)"
          : "compute and communication serialized (PARTIR_ASYNC=0)";
  std::printf("# predicted time: %s; measured: slowest device, best of %d steps\n", time_model.c_str(), o.reps);
  std::printf("%7s  %-8s %-18s %9s %9s %7s %9s %9s %10s %10s %7s\n", "devices", "strategy", "mesh", "pred(ms)",
              "meas(ms)", "err%", "pred comm", "meas comm", "pred(MiB)", "meas(MiB)", "err%");
  std::vector<double> pt, mt, pm, mm;
  double worst_time = 0, worst_memory = 0;
  for (const auto& r : results) {
    const Measured& m = r.measured;
    const double t_err = (r.predicted.step_seconds - m.seconds) / m.seconds * 100;
    const double m_err =
        static_cast<double>(r.predicted.peak_bytes - m.peak_bytes) / static_cast<double>(m.peak_bytes) * 100;
    worst_time = std::max(worst_time, std::abs(t_err));
    worst_memory = std::max(worst_memory, std::abs(m_err));
    std::printf("%7lld  %-8s %-18s %9.2f %9.2f %+7.1f %9.2f %9.2f %10.2f %10.2f %+7.2f\n", static_cast<long long>(r.devices),
                r.strategy.c_str(), r.mesh.c_str(), r.predicted.step_seconds * 1e3, m.seconds * 1e3, t_err,
                r.predicted.communication_seconds * 1e3, m.communication_seconds * 1e3,
                static_cast<double>(r.predicted.peak_bytes) / (1 << 20), static_cast<double>(m.peak_bytes) / (1 << 20),
                m_err);
    pt.push_back(r.predicted.step_seconds);
    mt.push_back(r.measured.seconds);
    pm.push_back(static_cast<double>(r.predicted.peak_bytes));
    mm.push_back(static_cast<double>(r.measured.peak_bytes));
  }
  std::printf("# time:        rank correlation %.3f, worst |error| %.1f%% (targets 1.0, 15%%)\n", spearman(pt, mt), worst_time);
  // Per device count too: the targets are for counts the cores can run at once (4 devices on 2 cores are not).
  std::vector<std::int64_t> counts;
  for (const auto& r : results)
    if (std::find(counts.begin(), counts.end(), r.devices) == counts.end()) counts.push_back(r.devices);
  for (std::size_t i = 0; counts.size() > 1 && i < counts.size(); ++i) {
    std::vector<double> predicted, measured;
    double worst = 0;
    for (const auto& r : results)
      if (r.devices == counts[i]) {
        predicted.push_back(r.predicted.step_seconds), measured.push_back(r.measured.seconds);
        worst = std::max(worst, std::abs(predicted.back() - measured.back()) / measured.back() * 100);
      }
    std::printf("#   %lld devices: rank correlation %.3f, worst |error| %.1f%%\n", static_cast<long long>(counts[i]),
                spearman(predicted, measured), worst);
  }
  std::printf("# peak memory: rank correlation %.3f, worst |error| %.2f%% (targets 1.0, 5%%)\n", spearman(pm, mm), worst_memory);
  if (o.json_path.empty()) return;
  p::json::Value rows = p::json::Value::array();
  for (const auto& r : results)
    rows.push_back({{"devices", r.devices},
                    {"strategy", r.strategy},
                    {"mesh", r.mesh},
                    {"measured_seconds", r.measured.seconds},
                    {"measured_communication_seconds", r.measured.communication_seconds},
                    {"measured_peak_bytes", r.measured.peak_bytes},
                    {"predicted", r.predicted.to_json()}});
  p::json::write_file(o.json_path, {{"model", model},
                                    {"backend", o.backend},
                                    {"time_rank_correlation", spearman(pt, mt)},
                                    {"memory_rank_correlation", spearman(pm, mm)},
                                    {"results", rows}});
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    p::nn::Mlp mlp{"params/mlp", o.sizes};
    const p::Program step = p::train_step([&](p::Tensor x, p::Tensor y) { return p::mse(mlp(x), y); }, p::Adam{},
                                          {{"x", {o.batch, o.sizes.front()}}, {"y", {o.batch, o.sizes.back()}}});
    std::string model = "MLP train step (batch " + std::to_string(o.batch) + ", ";
    for (std::size_t i = 0; i < o.sizes.size(); ++i) model += (i ? "-" : "") + std::to_string(o.sizes[i]);
    model += ", ReLU, MSE, Adam, f32)";
    const p::NamedArrays global = p::init_inputs(step, 0, true);
    if (!o.trace_dir.empty()) std::filesystem::create_directories(o.trace_dir);
    std::vector<Result> results;
    const std::string load = load_average();
    if (o.backend == "threads") {
      for (auto n : o.devices)
        p::threads::run(static_cast<int>(n), [&](p::threads::Communicator& c) { run_device_count(c, o, step, global, results); });
      report(results, o, model, load);
    } else if (o.backend == "mpi") {
#ifdef PARTIR_BENCH_MPI
      p::mpi::Session session(argc, argv);
      p::mpi::Communicator comm;
      run_device_count(comm, o, step, global, results);
      if (comm.device() == 0) report(results, o, model, load);
#else
      fail("--backend mpi: this build has no MPI");
#endif
    } else {
      fail("unknown backend '" + o.backend + "' (threads or mpi)");
    }
  } catch (const p::UserError& e) {
    std::cerr << "simulator_accuracy: " << e.what() << "\n";
    return 2;
  }
  return 0;
}

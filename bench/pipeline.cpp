// Pipeline schedules on a GPT train step (8 layers, d_model 128, seq 64, batch 16, Adam) over stage=2 and
// stage=4, M = 1, 2, 4, 8 microbatches: GPipe, 1F1B, zb1 (ZB-H1), interleaved:2 and zbv. Per row: the step
// time, the bubble (the fraction of the step a stage waits in recvs, averaged over stages) measured from the
// devices' timelines and predicted by the simulator from the same program, the published bubble, stage 0's peak
// activation memory (its peak less the state it holds) and the stages' predicted busy time, slowest over
// fastest. Published: GPipe and 1F1B (p - 1) / (M + p - 1); interleaved (p - 1) / (vM + p - 1); zb1 about a
// third of 1F1B's where F, B and W cost alike. Steps run one ExecutionPlan made beforehand, as an Executable
// does. Prints, last:
//   bubble predicted vs measured: worst |error| E                      (target <= 0.1 under MPI at p=2)
//   1f1b/gpipe peak activation memory (p=4, M=8): R
//   zb1/1f1b bubble (p=4, M=8): predicted R, measured R                (target <= 0.45)
//   interleaved(v=2)/1f1b bubble (p=4, M=8): predicted R, measured R   (target <= 0.6)
//   zb1/1f1b peak memory (p=4, M=8): R                                 (target <= 1.05)
//   1f1b/gpipe peak activation memory (p=4, M=8), GPT d256 seq 512: R  (target <= 0.6; a model whose activations
//                                                                       dominate, predicted: the simulator's
//                                                                       memory is the executor's)
//   by work/by count step (p=2, M=8, vocab 4096): predicted R, measured R  (stages cut by predicted work against
//                                                                       equal layer counts, with a heavy head)
// On the threads backend 4 device threads oversubscribe 2 cores: their measured bubbles include descheduled
// peers. `pipeline --mpi` under `mpirun -np P` runs the rows of P stages with one rank per stage.
// usage: pipeline [reps] [--mpi]
#include <partir/partir.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>

#include "../examples/cli.hpp"

#ifdef PARTIR_BENCH_MPI
#include <partir/runtime/comm/mpi.hpp>
#endif

namespace p = partir;

namespace {

constexpr long batch = 16;
const p::nn::GptConfig config{.vocab = 256, .seq = 64, .d_model = 128, .heads = 4, .layers = 8};

const std::vector<p::PipelineSchedule> schedules{p::PipelineSchedule::gpipe, p::PipelineSchedule::one_f_one_b,
                                                 p::PipelineSchedule::zb1, p::PipelineSchedule::interleaved(2),
                                                 p::PipelineSchedule::zbv};

struct Run {
  double ms = 0, bubble = 0, predicted_bubble = 0, imbalance = 0, predicted_ms = 0;
  std::vector<double> busy_ms, predicted_busy_ms;  // per stage
  std::int64_t activations = 0, peak = 0;  // stage 0, measured
};

p::Program gpt_step(const p::nn::GptConfig& c, int m) {
  const p::nn::Gpt model{c};
  return p::train_step([&](p::Tensor t, p::Tensor y) { return model.loss(t, y); }, p::Adam{1e-3},
                       {{"tokens", {batch, c.seq}, p::DType::i32}, {"targets", {batch, c.seq}, p::DType::i32}},
                       p::StepOptions{.microbatches = m});
}

p::SpmdProgram pipelined(const p::Program& step, int stages, const p::PipelineSchedule& schedule) {
  return p::lower(p::partition(step, p::Mesh{{"stage", stages}}, {p::pipeline("stage", schedule)}));
}

// The state stage 0 holds for the whole step.
std::int64_t held_by_stage_0(const p::SpmdProgram& spmd) {
  std::int64_t held = 0;
  const p::SpmdProgram first = p::stage_program(spmd, 0);
  for (const auto& b : first.inputs()) held += first.type(b.value).bytes();
  return held;
}

bool runs(const p::PipelineSchedule& s, int stages, int m) {
  return s.chunks == 1 || s.v_shape || m % stages == 0;
}

// A device's step from its timeline: the time it waited in recvs, the time it ran anything else, its end.
struct DeviceTimes {
  double waited = 0, busy = 0, end = 0;
  double bubble() const { return end > 0 ? waited / end : 0; }
};
DeviceTimes times_of(const p::SpmdProgram& spmd, const p::DeviceResult& d) {
  DeviceTimes times;
  for (const auto& t : d.timeline) {
    times.end = std::max(times.end, t.start + t.seconds);
    const auto& c = spmd.op(t.value).collective;
    (c && c->kind == p::CollectiveKind::recv ? times.waited : times.busy) += t.seconds;
  }
  return times;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Predicted figures of a pipelined program.
void predict(const p::SpmdProgram& spmd, Run& r) {
  const p::Report report = p::simulate(spmd, p::HardwareProfile::detect());
  r.predicted_bubble = report.bubble_fraction;
  double most = 0, least = 1e300;
  for (const auto& st : report.stages) {
    most = std::max(most, st.busy_seconds), least = std::min(least, st.busy_seconds);
    r.predicted_busy_ms.push_back(st.busy_seconds * 1e3);
  }
  r.imbalance = most / least;
  r.predicted_ms = report.step_seconds * 1e3;
}

p::NamedArrays random_state(const p::Program& step) {
  p::NamedArrays state = p::init_inputs(step, 0, true);
  std::mt19937_64 rng(1);
  for (const char* name : {"tokens", "targets"})
    for (std::int64_t i = 0; i < state.at(name).size(); ++i) state.at(name).set(i, static_cast<double>(rng() % config.vocab));
  return state;
}

// One step as the devices ran it: its wall time, the bubble averaged over the devices, stage 0's peak, each
// device's busy time.
struct Step {
  double ms = 0, bubble = 0;
  std::int64_t stage_0_peak = 0;
  std::vector<double> busy_ms;
};

// The median of `reps` steps of `spmd`, pipelined from `step` (after one that warms buffers and primitives up),
// run by run_step(plan, spmd, state).
template <class RunStep>
Run measure(const p::Program& step, const p::SpmdProgram& spmd, int reps, RunStep run_step) {
  Run r;
  predict(spmd, r);
  const std::int64_t held = held_by_stage_0(spmd);
  const p::NamedArrays state = random_state(step);
  const p::ExecutionPlan plan(spmd);
  std::vector<double> ms, bubbles;
  std::vector<std::vector<double>> busy;
  for (int i = 0; i <= reps; ++i) {
    const Step s = run_step(plan, spmd, state);
    if (i == 0) continue;
    ms.push_back(s.ms);
    bubbles.push_back(s.bubble);
    busy.resize(s.busy_ms.size());
    for (std::size_t d = 0; d < s.busy_ms.size(); ++d) busy[d].push_back(s.busy_ms[d]);
    r.peak = std::max(r.peak, s.stage_0_peak);
    r.activations = std::max(r.activations, s.stage_0_peak - held);
  }
  r.ms = median(ms);
  r.bubble = median(bubbles);
  for (const auto& b : busy) r.busy_ms.push_back(median(b));
  p::kernels::buffer_cache().clear();
  return r;
}

Step threads_step(const p::ExecutionPlan& plan, const p::SpmdProgram& spmd, const p::NamedArrays& state) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto results = p::execute_on_threads(plan, state, {.timeline = true});
  Step s{std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(), 0, results[0].peak_bytes, {}};
  for (const auto& d : results) {
    const DeviceTimes times = times_of(spmd, d);
    s.bubble += times.bubble() / static_cast<double>(results.size());
    s.busy_ms.push_back(times.busy * 1e3);
  }
  return s;
}

template <class RunStep>
Run measure(int stages, int m, const p::PipelineSchedule& schedule, int reps, RunStep run_step) {
  const p::Program step = gpt_step(config, m);
  return measure(step, pipelined(step, stages, schedule), reps, run_step);
}

// A head as costly as a few layers (vocabulary 4096): 1F1B on 2 stages, M = 8, the layers cut by predicted work
// (the default) and in equal counts. Prints each cut's stages' busy time, predicted and measured, then
//   by work/by count busiest stage (p=2, M=8, vocab 4096): predicted R, measured R
//   by work/by count step (p=2, M=8, vocab 4096): predicted R, measured R
// (2 stages: one device per core; the step's ratio moves with the machine's noise more than the busiest stage's).
template <class RunStep>
void stage_balance(int reps, RunStep run_step, bool print) {
  p::nn::GptConfig heavy_head = config;
  heavy_head.vocab = 4096;
  const p::Program step = gpt_step(heavy_head, 8);
  Run runs[2];
  double busiest[2][2] = {};  // [cut][predicted, measured]
  for (int i = 0; i < 2; ++i) {
    const auto balance = i == 0 ? p::StageBalance::cost : p::StageBalance::layers;
    const p::Partitioned plan = p::partition(step, p::Mesh{{"stage", 2}}, {p::pipeline("stage", p::PipelineSchedule::one_f_one_b, {}, balance)});
    const p::SpmdProgram spmd = p::lower(plan);
    Run& r = runs[i] = measure(step, spmd, reps, run_step);
    if (!print) continue;
    std::printf("vocab 4096, stages by %s:", balance == p::StageBalance::cost ? "work " : "count");
    const auto& pp = *plan.state().pipeline();
    for (std::size_t s = 0; s < r.predicted_busy_ms.size(); ++s) {
      const double predicted_ms = r.predicted_busy_ms[s];
      std::printf("  stage %zu (%s) busy %.1f ms, measured %.1f ms;", s, pp.cut[s].substr(0, pp.cut[s].find(',')).c_str(),
                  predicted_ms, r.busy_ms.at(s));
      busiest[i][0] = std::max(busiest[i][0], predicted_ms);
      busiest[i][1] = std::max(busiest[i][1], r.busy_ms.at(s));
    }
    std::printf(" step %.1f ms, measured %.1f ms\n", r.predicted_ms, r.ms);
  }
  if (print) {
    std::printf("by work/by count busiest stage (p=2, M=8, vocab 4096): predicted %.2f, measured %.2f\n",
                busiest[0][0] / busiest[1][0], busiest[0][1] / busiest[1][1]);
    std::printf("by work/by count step (p=2, M=8, vocab 4096): predicted %.2f, measured %.2f\n",
                runs[0].predicted_ms / runs[1].predicted_ms, runs[0].ms / runs[1].ms);
  }
}

void print_header(const char* backend) {
  std::printf("GPT %lld layers, d_model %lld, seq %lld, batch %ld; %s backend, one device per stage\n",
              static_cast<long long>(config.layers), static_cast<long long>(config.d_model),
              static_cast<long long>(config.seq), batch, backend);
  std::printf("%6s %4s %-14s %10s %10s %10s %10s %14s %10s\n", "stages", "M", "schedule", "step ms", "published",
              "predicted", "measured", "stage-0 act.", "busy max/min");
}

double published(const p::PipelineSchedule& s, int stages, int m) {
  const double bubble_1f1b = static_cast<double>(stages - 1) / (m + stages - 1);
  if (s.splits_backward()) return -1;  // depends on the costs of F, B and W
  if (s.chunks > 1) return static_cast<double>(stages - 1) / (s.chunks * m + stages - 1);
  return bubble_1f1b;
}

void print_row(int stages, int m, const p::PipelineSchedule& s, const Run& r) {
  const double pub = published(s, stages, m);
  std::printf("%6d %4d %-14s %10.1f %10s %10.3f %10.3f %14s %10.2f\n", stages, m, p::name_of(s).c_str(), r.ms,
              pub < 0 ? "-" : std::to_string(pub).substr(0, 5).c_str(), r.predicted_bubble, r.bubble,
              p::human_bytes(static_cast<double>(r.activations)).c_str(), r.imbalance);
  std::fflush(stdout);
}

// The ratios of the p=4, M=8 rows (or the largest p run) that the targets name.
struct Ratios {
  int stages = 4;
  std::map<std::string, Run> at;  // schedule name -> its run at p, M = 8
  void print() const {
    if (!at.contains("1f1b")) return;
    const Run& one = at.at("1f1b");
    auto bubble = [&](const char* name, const char* label) {
      if (!at.contains(name)) return;
      std::printf("%s (p=%d, M=8): predicted %.2f, measured %.2f\n", label, stages, at.at(name).predicted_bubble / one.predicted_bubble,
                  at.at(name).bubble / one.bubble);
    };
    if (at.contains("gpipe"))
      std::printf("1f1b/gpipe peak activation memory (p=%d, M=8): %.2f\n", stages,
                  static_cast<double>(one.activations) / static_cast<double>(at.at("gpipe").activations));
    bubble("zb1", "zb1/1f1b bubble");
    bubble("interleaved:2", "interleaved(v=2)/1f1b bubble");
    if (at.contains("zb1"))
      std::printf("zb1/1f1b peak memory (p=%d, M=8): %.2f\n", stages, static_cast<double>(at.at("zb1").peak) / static_cast<double>(one.peak));
  }
};

// A model whose activations dominate: stage 0's activation memory under 1F1B over GPipe, predicted.
void activation_dominated() {
  const p::nn::GptConfig big{.vocab = 256, .seq = 512, .d_model = 256, .heads = 4, .layers = 8};
  const p::Program step = gpt_step(big, 8);
  std::int64_t act[2] = {0, 0};
  int i = 0;
  for (const auto& s : {p::PipelineSchedule::gpipe, p::PipelineSchedule::one_f_one_b}) {
    const p::SpmdProgram spmd = pipelined(step, 4, s);
    act[i++] = p::simulate(spmd, p::HardwareProfile::detect()).stages[0].peak_bytes - held_by_stage_0(spmd);
  }
  std::printf("1f1b/gpipe peak activation memory (p=4, M=8), GPT d256 seq 512 8 layers, predicted: %.2f\n",
              static_cast<double>(act[1]) / static_cast<double>(act[0]));
}

#ifdef PARTIR_BENCH_MPI
int run_mpi(int argc, char** argv, int reps) {
  p::mpi::Session session(argc, argv);
  p::mpi::Communicator world;
  const int stages = session.size();
  const bool root = session.rank() == 0;
  // One step on every rank: the slowest rank's time, the bubble averaged over the ranks, stage 0's peak.
  const auto mpi_step = [&](const p::ExecutionPlan& plan, const p::SpmdProgram& spmd, const p::NamedArrays& state) {
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    const p::DeviceResult d = p::execute(plan, world, state, {.timeline = true});
    const DeviceTimes times = times_of(spmd, d);
    Step s{std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
           times.bubble() / stages, root ? d.peak_bytes : 0, std::vector<double>(static_cast<std::size_t>(stages))};
    const double busy_ms = times.busy * 1e3;
    MPI_Gather(&busy_ms, 1, MPI_DOUBLE, s.busy_ms.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &s.ms, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &s.bubble, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &s.stage_0_peak, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    return s;
  };
  if (root) print_header(("MPI (" + std::to_string(stages) + " ranks)").c_str());
  double worst = 0;
  Ratios ratios{stages, {}};
  for (int m : {1, 2, 4, 8})
    for (const auto& schedule : schedules) {
      if (!runs(schedule, stages, m) || (schedule.chunks > 1 && config.layers < stages * schedule.chunks)) continue;
      const Run r = measure(stages, m, schedule, reps, mpi_step);
      if (!root) continue;
      print_row(stages, m, schedule, r);
      worst = std::max(worst, std::abs(r.predicted_bubble - r.bubble));
      if (m == 8) ratios.at[p::name_of(schedule)] = r;
    }
  if (root) {
    std::printf("bubble predicted vs measured under MPI (p=%d): worst |error| %.3f\n", stages, worst);
    ratios.print();
  }
  if (stages == 2) stage_balance(reps, mpi_step, root);
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Pipeline schedules on a GPT: step time, bubble predicted vs measured, stage-0 memory.", "pipeline");
  int reps = 3;
  bool mpi = false;
  app.add_option("reps", reps, "timed steps per configuration (the median counts)")->check(cli::at_least(1));
  app.add_flag("--mpi", mpi, "one rank per stage under mpirun -np P (P = 2 or 4): the rows of P stages");
  app.parse(argc, argv);
  if (mpi) {
#ifdef PARTIR_BENCH_MPI
    return run_mpi(argc, argv, reps);
#else
    std::fprintf(stderr, "pipeline --mpi: this build has no MPI\n");
    return 2;
#endif
  }
  print_header("threads");
  double worst = 0;
  Ratios ratios;
  for (int stages : {2, 4})
    for (int m : {1, 2, 4, 8})
      for (const auto& schedule : schedules) {
        if (!runs(schedule, stages, m)) continue;
        const Run r = measure(stages, m, schedule, reps, threads_step);
        print_row(stages, m, schedule, r);
        worst = std::max(worst, std::abs(r.predicted_bubble - r.bubble));
        if (stages == 4 && m == 8) ratios.at[p::name_of(schedule)] = r;
      }
  std::printf("bubble predicted vs measured: worst |error| %.3f\n", worst);
  ratios.print();
  activation_dominated();
  stage_balance(reps, threads_step, true);
}

#pragma once
// simulate(plan, profile): walks the per-device program of an ExecutionPlan in order, costs each local op with
// the roofline and each collective with its ring formula (sim/cost_model.hpp), and replays buffer liveness
// exactly as the executor accounts it, from the plan's own frees: inputs resident for the whole step (donated
// state until its last use), an intermediate from its op to its last use (an op's operands and result count
// together), outputs to the end.
//
// Time runs on two streams per device, as the executor runs the program (runtime/comm/comm_stream.hpp): local ops
// in program order on the compute stream, each starting when its operands are ready; collectives in program
// order on the communication stream, each starting once the compute stream has issued it and its operand is
// ready (a small one while that stream is idle: inline, on the compute stream). With overlap off (or in a
// pipelined program) one stream runs everything in order.
#include "partir/config.hpp"
#include "partir/sim/cost_model.hpp"
#include "partir/sim/report.hpp"
#include "partir/spmd/execution_plan.hpp"
#include "partir/spmd/pipeline.hpp"

namespace partir {


// How timelines (simulated and measured) name an op: what it does, "dot_general" or "all_reduce{batch}", and
// which value it makes, its name or tag else %id.
inline std::string timeline_what(const SpmdOp& s) {
  return s.collective ? std::string(name_of(s.collective->kind)) + to_string(s.collective->axes)
                      : std::string(name_of(s.op.kind));
}
inline std::string timeline_label(const SpmdOp& s, ValueId v) {
  return s.op.name.empty() ? "%" + std::to_string(v) : s.op.name;
}

// How the plan is made (overlap, stream_min_bytes, donate_state): the executor's choices to simulate.
using SimulateOptions = PlanOptions;

// What one device's step costs (in a pipelined program: the step of all stages together; Report::stages has
// each stage's).
PARTIR_ENTRY Report simulate(const ExecutionPlan& plan, const HardwareProfile& hw);
inline Report simulate(const SpmdProgram& p, const HardwareProfile& hw, const SimulateOptions& options = {}) {
  return simulate(ExecutionPlan::borrowing(p, options), hw);
}

// A pipelined step of `microbatches` microbatches, predicted from a plan of the same step built with 3 or more
// (one between two others stands for each: its backward adds to the gradients' running sums and passes them on):
// a microbatch's tasks are simulated once and the schedule's task list for `microbatches` is replayed over them,
// so neither the program nor the simulation grows with the microbatches (Megatron-LM's runs have hundreds a
// step). Time: each virtual stage's F, B and W of that microbatch, and each stage's update, are timed as
// simulate() times their ops; each device runs its tasks in the schedule's order, a task starting once the
// device is free and what it reads has arrived (F: the previous virtual stage's F of its microbatch plus that
// stage's sends; B: its F and the next virtual stage's B plus its sends; W: its B). Memory: each stage's
// simulated peak, plus what more microbatches hold: the buffers that outlive the task that makes them
// (activations kept for the backward pass, running sums, parameter casts the microbatches share), held from the
// task that makes them to the one that frees them in the replay, at their most with `microbatches` less at their
// most with the program's own. GEMM FLOPs scale with the microbatches.
PARTIR_ENTRY Report simulate_repeated(const ExecutionPlan& plan, const HardwareProfile& hw, int microbatches);
inline Report simulate_repeated(const SpmdProgram& p, const HardwareProfile& hw, int microbatches,
                                const SimulateOptions& options = {}) {
  return simulate_repeated(ExecutionPlan::borrowing(p, options), hw, microbatches);
}

#if PARTIR_DEFINE_ENTRIES
namespace detail {

// `device`: one of the stage's devices, whose groups' placement on hosts is costed (every device of a stage runs
// the same program; a profile without hosts costs any group alike).
inline Report simulate_stage(const StagePlan& plan, const HardwareProfile& hw, std::int64_t device = 0) {
  const SpmdProgram& p = *plan.program;
  const Mesh& mesh = p.mesh();
  Report r;
  r.program = p.name();
  r.profile = hw.name;
  r.mesh = mesh;
  r.memory_capacity = hw.memory_capacity;

  const auto& kinds = plan.kinds;
  MemoryBreakdown resident;
  for (const auto& b : p.inputs()) resident[kinds[static_cast<std::size_t>(b.value)]] += p.type(b.value).bytes();
  r.inputs = r.peak = resident;
  r.peak_bytes = resident.total();
  // Memory as the executor runs it: fused elementwise chains (spmd/fusion.hpp) never hold their inner
  // values, and a group's inputs live until its root.
  const FusionPlan& fusion = plan.fusion;
  const auto& frees = plan.frees();
  const auto& donated = plan.donated;
  const bool overlap = plan.overlap;

  // Reuse distances: the bytes this device touched so far, and when it last touched each value. A program
  // input was last touched a step ago (a step reads its parameters once): the step's whole traffic before.
  double touched = 0, step_traffic = 0;
  for (ValueId v = 0; v < p.size(); ++v)
    if (!detail::is_program_input(p.op(v)) && fusion.runs_at(v)) {
      step_traffic += static_cast<double>(p.type(v).bytes());
      for (auto o : p.op(v).op.operands) step_traffic += static_cast<double>(p.type(o).bytes());
    }
  std::vector<double> last_touch(static_cast<std::size_t>(p.size()), -step_traffic);
  double compute_clock = 0, communication_clock = 0;  // when each stream is free (without overlap: one clock)
  std::vector<double> ready(static_cast<std::size_t>(p.size()), 0);  // when each value exists
  std::vector<TensorType> operand_types;
  for (ValueId v = 0; v < p.size(); ++v) {
    const SpmdOp& s = p.op(v);
    if (!detail::is_program_input(s)) {
      TimedOp t;
      t.value = v;
      t.what = timeline_what(s);
      t.label = timeline_label(s, v);
      double operands_ready = 0;
      for (auto o : s.op.operands) operands_ready = std::max(operands_ready, ready[static_cast<std::size_t>(o)]);
      if (const FusionGroup* g = fusion.group_at(v))
        for (const auto& in : g->inputs) operands_ready = std::max(operands_ready, ready[static_cast<std::size_t>(in.value)]);
      operand_types.clear();
      for (auto o : s.op.operands) operand_types.push_back(p.type(o));
      if (s.communicates()) {
        const Collective& c = *s.collective;
        t.communication = true;
        t.group_size = is_point_to_point(c.kind) ? 2 : group_size(c, mesh);
        t.bytes = static_cast<double>(std::max(operand_types.empty() ? 0 : operand_types[0].bytes(), s.op.type.bytes()));
        t.wire_bytes = wire_bytes(c.kind, t.group_size, t.bytes);
        t.seconds = collective_seconds(c, mesh, device, t.bytes, hw);
        t.bound = "link";
        t.reason = c.reason;
        r.communication_seconds += t.seconds;
        r.wire_bytes += t.wire_bytes;
      } else {
        // A local op, or an all_slice: a local copy of this device's tile, costed as a slice (it reads the tile).
        Work w = s.collective ? Work{0, 2 * static_cast<double>(s.op.type.bytes())} : local_work(s.op, operand_types);
        // A fused elementwise chain is one pass over memory: its inner ops only compute (no dispatch, no
        // buffer), its root reads the group's inputs once and writes its result and side outputs.
        if (const FusionGroup* g = fusion.group_at(v)) {
          w.bytes = static_cast<double>(s.op.type.bytes() * static_cast<std::int64_t>(1 + g->side_outputs.size()));
          for (const auto& in : g->inputs) {
            w.bytes += static_cast<double>(p.type(in.value).bytes());
            w.reuse = std::max(w.reuse, touched - last_touch[static_cast<std::size_t>(in.value)]);
          }
        } else {
          for (auto o : s.op.operands) w.reuse = std::max(w.reuse, touched - last_touch[static_cast<std::size_t>(o)]);
        }
        if (!fusion.runs_at(v)) {  // computed in registers by each group that reads it (or stores it)
          w.flops *= fusion.copies(v);
          t.bytes = 0;
          t.seconds = w.flops / hw.flops_per_second(s.op.kind, s.op.type.dtype);
          t.bound = "fused";
        } else {
          bool compute_bound = false;
          t.bytes = w.bytes;
          const OpKind kind = s.collective ? OpKind::slice : s.op.kind;
          t.seconds = roofline_seconds(w, kind, s.op.type.dtype, hw, &compute_bound);
          t.bound = compute_bound ? "compute" : "memory";
        }
        t.flops = w.flops;
        r.compute_seconds += t.seconds;
        r.flops += w.flops;
      }
      if (!overlap) {
        t.start = compute_clock;
        compute_clock += t.seconds;
      } else if (plan.streamed(v, /*stream_busy=*/communication_clock > compute_clock)) {
        // streamed: issued once the compute stream reaches it; the compute stream pays what it cannot overlap
        t.start = std::max({communication_clock, compute_clock, operands_ready});
        communication_clock = t.start + t.seconds;
        compute_clock += (1 - hw.overlap) * t.seconds;
      } else {  // a local op, or a small collective inline while the stream is idle
        t.start = std::max(compute_clock, operands_ready);
        compute_clock = t.start + t.seconds;
        if (t.communication) communication_clock = compute_clock;
      }
      ready[static_cast<std::size_t>(v)] = t.start + t.seconds;
      if (fusion.runs_at(v)) {
        touched += t.bytes;
        for (auto o : s.op.operands) last_touch[static_cast<std::size_t>(o)] = touched;
        last_touch[static_cast<std::size_t>(v)] = touched;
        resident[kinds[static_cast<std::size_t>(v)]] += s.op.type.bytes();
        if (const FusionGroup* g = fusion.group_at(v)) {
          for (const auto& in : g->inputs) last_touch[static_cast<std::size_t>(in.value)] = touched;
          for (int k : g->side_outputs) {
            const ValueId side = g->steps[static_cast<std::size_t>(k)].value;
            last_touch[static_cast<std::size_t>(side)] = touched;
            resident[kinds[static_cast<std::size_t>(side)]] += p.type(side).bytes();
          }
        }
      }
      r.timeline.push_back(std::move(t));

      if (resident.total() > r.peak_bytes) {
        r.peak_bytes = resident.total();
        r.peak = resident;
        r.peak_at = v;
      }
    }
    for (auto dead : frees[static_cast<std::size_t>(v)])
      if (!detail::is_program_input(p.op(dead)) || donated[static_cast<std::size_t>(dead)])
        resident[kinds[static_cast<std::size_t>(dead)]] -= p.type(dead).bytes();
  }
  r.overlap = overlap;
  r.step_seconds = overlap ? std::max(compute_clock, communication_clock) : r.compute_seconds + r.communication_seconds;
  r.hidden_communication_seconds = std::max(0.0, r.compute_seconds + r.communication_seconds - r.step_seconds);
  return r;
}

// A pipelined step's totals per device: the whole step's work spread over the stages; the bubble, each stage's
// idle share of the step, averaged.
inline void spread_over_stages(Report& r) {
  const auto stages = static_cast<double>(r.stages.size());
  r.compute_seconds /= stages;
  r.communication_seconds /= stages;
  r.flops /= stages;
  r.wire_bytes /= stages;
  for (const auto& st : r.stages) r.bubble_fraction += r.step_seconds > 0 ? 1 - st.busy_seconds / r.step_seconds : 0;
  r.bubble_fraction /= stages;
}

// A pipelined step: each stage simulated alone, then replayed in the program's order on one clock per stage,
// where a send's data arrives one link hop after the sender's clock and a recv waits until it has.
inline Report simulate_pipeline(const ExecutionPlan& plan, const HardwareProfile& hw) {
  const SpmdProgram& p = plan.program();
  const int stages = p.pipeline()->stages;
  std::vector<Report> alone;
  std::vector<std::pair<int, const TimedOp*>> timed(static_cast<std::size_t>(p.size()), {-1, nullptr});
  for (const StagePlan& stage : plan.stages()) {
    std::int64_t first = 0;  // the stage's first device
    while (first + 1 < p.mesh().num_devices() && p.stage_of(first) != stage.stage) ++first;
    alone.push_back(simulate_stage(stage, hw, first));
  }
  for (const StagePlan& stage : plan.stages())
    for (const auto& t : alone[static_cast<std::size_t>(stage.stage)].timeline)
      timed[static_cast<std::size_t>(stage.original(t.value))] = {stage.stage, &t};

  Report r;
  r.program = p.name();
  r.profile = hw.name;
  r.mesh = p.mesh();
  r.memory_capacity = hw.memory_capacity;
  r.stages.resize(static_cast<std::size_t>(stages));
  std::vector<double> clock(static_cast<std::size_t>(stages), 0);
  std::map<std::int64_t, double> arrives;  // send tag -> when its data is at the receiver
  for (ValueId v = 0; v < p.size(); ++v) {
    const auto [s, original] = timed[static_cast<std::size_t>(v)];
    if (!original) continue;
    TimedOp t = *original;
    t.value = v;
    t.stage = s;
    double& now = clock[static_cast<std::size_t>(s)];
    StageReport& st = r.stages[static_cast<std::size_t>(s)];
    const auto& c = p.op(v).collective;
    t.start = now;
    if (c && c->kind == CollectiveKind::send) {
      arrives[c->tag] = now + t.seconds;
      st.p2p_bytes += t.bytes;
      t.seconds = 0;  // nonblocking: the sender goes on
    } else if (c && c->kind == CollectiveKind::recv) {
      const double ready = std::max(now, arrives.at(c->tag));
      t.seconds = ready - now;
      st.wait_seconds += t.seconds;
    } else {
      st.busy_seconds += t.seconds;
      if (t.communication) r.communication_seconds += t.seconds, r.wire_bytes += t.wire_bytes;
      else r.compute_seconds += t.seconds, r.flops += t.flops;
    }
    now += t.seconds;
    r.timeline.push_back(std::move(t));
  }
  for (int s = 0; s < stages; ++s) {
    auto& st = r.stages[static_cast<std::size_t>(s)];
    const Report& a = alone[static_cast<std::size_t>(s)];
    st.finish_seconds = clock[static_cast<std::size_t>(s)];
    st.peak_bytes = a.peak_bytes;
    st.peak = a.peak;
    r.step_seconds = std::max(r.step_seconds, st.finish_seconds);
    if (a.peak_bytes >= r.peak_bytes) {
      r.peak_bytes = a.peak_bytes;
      r.peak = a.peak;
      r.inputs = a.inputs;
      r.peak_at = a.peak_at >= 0 ? plan.stages()[static_cast<std::size_t>(s)].original(a.peak_at) : -1;
    }
  }
  spread_over_stages(r);
  return r;
}

// Report's model and hardware FLOPs: every GEMM and convolution of the program once (a pipeline's over its
// stages' devices), the ones remat recomputes in the hardware's only; the peak of the dtype they mostly run in.
inline void count_gemm_flops(const SpmdProgram& p, const HardwareProfile& hw, Report& r) {
  std::map<DType, double> by_dtype;
  std::vector<TensorType> in;
  for (ValueId v = 0; v < p.size(); ++v) {
    const SpmdOp& s = p.op(v);
    if (s.collective || (s.op.kind != OpKind::dot_general && s.op.kind != OpKind::convolution)) continue;
    in.clear();
    for (auto o : s.op.operands) in.push_back(p.type(o));
    const double flops = local_work(s.op, in).flops;
    r.hardware_flops += flops;
    if (!s.recomputed) r.model_flops += flops;
    by_dtype[in.front().dtype] += flops;
  }
  const double devices_per_op = p.pipeline() ? p.pipeline()->stages : 1;
  r.model_flops /= devices_per_op;
  r.hardware_flops /= devices_per_op;
  double most = 0;
  for (const auto& [dtype, flops] : by_dtype)
    if (flops > most) most = flops, r.flops_dtype = dtype;
  const auto peak = hw.peak_flops.find(r.flops_dtype);
  r.peak_flops = peak == hw.peak_flops.end() ? 0 : peak->second;
}

// One microbatch's tasks on each stage (simulate_repeated): their times, their sends, the buffers they hold.
struct MicrobatchTasks {
  struct Totals {  // a stage's, as Report counts them
    double compute = 0, communication = 0, flops = 0, wire_bytes = 0, p2p_bytes = 0;
    void add(const TimedOp& t) {
      (t.communication ? communication : compute) += t.seconds;
      flops += t.flops;
      wire_bytes += t.wire_bytes;
    }
  };
  std::vector<TaskCosts> costs;              // per virtual stage: busy seconds of its F, B and W
  std::vector<TaskCosts> nominal;            // the same on the nominal machine: what cut_into_stages orders by
  std::vector<double> send_f, send_b;        // per virtual stage: seconds its F's and B's sends take on the link
  // Buffers that outlive the task that makes them (activations kept for the backward pass, the gradients'
  // running sums, parameter casts shared by the microbatches), by the tasks that make and free them, in the
  // program's microbatches: 0 the first, 1 one between others (repeated for each), the last; freed by the update:
  // held to the end. Per stage: bytes.
  struct Hold {
    StageTask made, freed;
    friend auto operator<=>(const Hold&, const Hold&) = default;
  };
  std::vector<std::map<Hold, double>> holds;
  std::vector<Totals> per_microbatch, update;  // per stage
};

inline MicrobatchTasks microbatch_tasks(const ExecutionPlan& plan, const HardwareProfile& hw, std::vector<Report>& alone) {
  using P = StageTask::Phase;
  const SpmdProgram& p = plan.program();
  const SpmdPipeline& pp = *p.pipeline();
  const auto stages = static_cast<std::size_t>(pp.stages), chunks = stages * static_cast<std::size_t>(pp.schedule.chunks);
  // A microbatch between others, where there is one: its backward adds to the running sums and leaves them to
  // the next (the last one's sums join the update's fused groups, the first has none to add to).
  const int middle = 1, last = pp.microbatches - 1;
  MicrobatchTasks out;
  out.costs.assign(chunks, TaskCosts{0, 0, 0});
  out.nominal = out.costs;
  std::vector<TensorType> operands;
  out.send_f = out.send_b = std::vector<double>(chunks);
  out.holds.resize(stages);
  out.per_microbatch = out.update = std::vector<MicrobatchTasks::Totals>(stages);
  for (const StagePlan& stage : plan.stages()) {
    std::int64_t first = 0;  // the stage's first device
    while (first + 1 < p.mesh().num_devices() && p.stage_of(first) != stage.stage) ++first;
    alone.push_back(simulate_stage(stage, hw, first));
    const SpmdProgram& sp = *stage.program;
    const auto s = static_cast<std::size_t>(stage.stage);
    for (const TimedOp& t : alone.back().timeline) {
      const SpmdOp& op = sp.op(t.value);
      const StageTask& k = op.task;
      const bool send = op.collective && op.collective->kind == CollectiveKind::send;
      if ((op.collective && op.collective->kind == CollectiveKind::recv) || (k.phase != P::update && k.microbatch != middle))
        continue;
      if (k.phase == P::update) {
        if (!send) out.update[s].add(t);
      } else if (send) {
        (k.phase == P::forward ? out.send_f : out.send_b)[static_cast<std::size_t>(k.chunk)] += t.seconds;
        out.per_microbatch[s].p2p_bytes += t.bytes;
      } else {
        auto phase_of = [&](TaskCosts& c) -> double& {
          return k.phase == P::forward ? c.forward : k.phase == P::backward ? c.backward : c.weight;
        };
        phase_of(out.costs[static_cast<std::size_t>(k.chunk)]) += t.seconds;
        operands.clear();
        for (ValueId o : op.op.operands) operands.push_back(sp.type(o));
        phase_of(out.nominal[static_cast<std::size_t>(k.chunk)]) += nominal_seconds(
            op.collective ? Work{0, 2.0 * static_cast<double>(op.op.type.bytes())} : local_work(op.op, operands));
        out.per_microbatch[s].add(t);
      }
    }
    const auto& frees = stage.frees();
    for (ValueId u = 0; u < sp.size(); ++u) {
      const StageTask& k = sp.op(u).task;
      for (ValueId dead : frees[static_cast<std::size_t>(u)]) {
        const StageTask& d = sp.op(dead).task;
        if (is_program_input(sp.op(dead)) || d.phase == P::update || d == k) continue;  // the update's, a task's own
        // The middle microbatch's stand for every microbatch's; the first's and the last's only where they are
        // not (they outlive their microbatch).
        const bool freed_later = k.phase == P::update || k.microbatch != d.microbatch;
        if (d.microbatch == middle || ((d.microbatch == 0 || d.microbatch == last) && freed_later))
          out.holds[s][{d, k}] += static_cast<double>(sp.type(dead).bytes());
      }
    }
  }
  return out;
}

// Each stage's clock, busy time and most bytes held past their task when the schedule's tasks for m microbatches run.
struct TaskReplay {
  std::vector<double> finish, busy, most_held;  // most_held: of the buffers that outlive their task
};
inline TaskReplay replay_tasks(const SpmdPipeline& pp, int m, const MicrobatchTasks& mb) {
  using P = StageTask::Phase;
  const auto stages = static_cast<std::size_t>(pp.stages);
  const int chunks = static_cast<int>(mb.costs.size());
  const auto order = pipeline_tasks(pp.schedule, pp.stages, m, pp.schedule.splits_backward() ? mb.nominal : std::vector<TaskCosts>{});
  std::vector<double> f_end(static_cast<std::size_t>(chunks * m), -1), b_end = f_end;
  TaskReplay r{std::vector<double>(stages), std::vector<double>(stages), std::vector<double>(stages)};
  // What each task adds to what its stage holds when it runs (made), and takes away when it ends (freed).
  std::vector<std::map<StageTask, double>> made(stages), freed(stages);
  for (std::size_t s = 0; s < stages; ++s)
    for (const auto& [h, bytes] : mb.holds[s]) {
      auto at = [&](StageTask t, int j) { return StageTask{t.chunk, t.phase, j}; };
      const bool to_end = h.freed.phase == P::update;
      const int last = pp.microbatches - 1;
      if (h.made.microbatch == 1) {  // each microbatch's, freed by its own task or the next microbatch's
        for (int j = 0; j < m; ++j) {
          made[s][at(h.made, j)] += bytes;
          const int k = j + h.freed.microbatch - 1;
          if (!to_end && k < m) freed[s][at(h.freed, k)] += bytes;
        }
      } else if (h.made.microbatch == 0) {  // the first's, freed by the last microbatch or a given one
        made[s][at(h.made, 0)] += bytes;
        if (!to_end) freed[s][at(h.freed, h.freed.microbatch == last ? m - 1 : std::min(h.freed.microbatch, m - 1))] += bytes;
      } else {
        made[s][at(h.made, m - 1)] += bytes;
      }
    }
  std::vector<double> held(stages);
  std::vector<std::size_t> next(stages);
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t s = 0; s < stages; ++s)
      for (; next[s] < order[s].size(); ++next[s]) {
        const StageTask& t = order[s][next[s]];
        const auto c = static_cast<std::size_t>(t.chunk);
        const auto at = static_cast<std::size_t>(t.chunk * m + t.microbatch);
        double start = r.finish[s], seconds = 0;
        if (t.phase == P::forward) {
          if (t.chunk > 0 && f_end[at - static_cast<std::size_t>(m)] < 0) break;
          if (t.chunk > 0) start = std::max(start, f_end[at - static_cast<std::size_t>(m)] + mb.send_f[c - 1]);
          seconds = mb.costs[c].forward;
        } else if (t.phase == P::backward) {
          if (t.chunk + 1 < chunks && b_end[at + static_cast<std::size_t>(m)] < 0) break;
          if (t.chunk + 1 < chunks) start = std::max(start, b_end[at + static_cast<std::size_t>(m)] + mb.send_b[c + 1]);
          seconds = mb.costs[c].backward;
        } else if (t.phase == P::weight) {
          seconds = mb.costs[c].weight;
        } else {
          seconds = mb.update[s].compute + mb.update[s].communication;
        }
        if (auto it = made[s].find(t); it != made[s].end()) held[s] += it->second;
        r.most_held[s] = std::max(r.most_held[s], held[s]);
        if (auto it = freed[s].find(t); it != freed[s].end()) held[s] -= it->second;
        r.finish[s] = start + seconds;
        r.busy[s] += seconds;
        if (t.phase == P::forward) f_end[at] = r.finish[s];
        if (t.phase == P::backward) b_end[at] = r.finish[s];
        progress = true;
      }
  }
  for (std::size_t s = 0; s < stages; ++s)
    if (next[s] < order[s].size()) internal_error("simulate_repeated: the schedule's tasks wait on each other");
  return r;
}

}  // namespace detail

PARTIR_ENTRY Report simulate_repeated(const ExecutionPlan& plan, const HardwareProfile& hw, int microbatches) {
  const SpmdProgram& p = plan.program();
  if (!p.pipeline())
    user_error("simulate_repeated: program '" + p.name() +
               "' is not pipelined (a step without stages is its one microbatch pass; simulate it)");
  if (microbatches < 1)
    user_error("simulate_repeated: " + std::to_string(microbatches) + " microbatches (a step runs at least 1)");
  const SpmdPipeline& pp = *p.pipeline();
  if (pp.microbatches < 3)
    user_error("simulate_repeated: program '" + p.name() + "' runs " + std::to_string(pp.microbatches) +
               " microbatches; it needs 3 or more (a microbatch between two others stands for each)");
  std::vector<Report> alone;
  const detail::MicrobatchTasks mb = detail::microbatch_tasks(plan, hw, alone);
  const detail::TaskReplay run = detail::replay_tasks(pp, microbatches, mb), own = detail::replay_tasks(pp, pp.microbatches, mb);
  Report r;
  r.program = p.name();
  r.profile = hw.name;
  r.mesh = p.mesh();
  r.memory_capacity = hw.memory_capacity;
  r.replayed_microbatches = microbatches;
  r.stages.resize(static_cast<std::size_t>(pp.stages));
  const double m = microbatches;
  for (std::size_t s = 0; s < r.stages.size(); ++s) {
    StageReport& st = r.stages[s];
    const auto& once = mb.update[s];
    const auto& each = mb.per_microbatch[s];
    st.busy_seconds = run.busy[s];
    st.finish_seconds = run.finish[s];
    st.wait_seconds = run.finish[s] - run.busy[s];
    st.p2p_bytes = m * each.p2p_bytes;
    st.peak = alone[s].peak;
    st.peak[MemoryKind::activations] += static_cast<std::int64_t>(run.most_held[s] - own.most_held[s]);
    st.peak_bytes = st.peak.total();
    r.step_seconds = std::max(r.step_seconds, st.finish_seconds);
    r.compute_seconds += m * each.compute + once.compute;
    r.communication_seconds += m * each.communication + once.communication;
    r.flops += m * each.flops + once.flops;
    r.wire_bytes += m * each.wire_bytes + once.wire_bytes;
    if (st.peak_bytes >= r.peak_bytes) {
      r.peak_bytes = st.peak_bytes;
      r.peak = st.peak;
      r.inputs = alone[s].inputs;
    }
  }
  detail::spread_over_stages(r);
  detail::count_gemm_flops(p, hw, r);
  r.model_flops *= m / pp.microbatches;  // GEMMs run in the microbatches' tasks only
  r.hardware_flops *= m / pp.microbatches;
  return r;
}

PARTIR_ENTRY Report simulate(const ExecutionPlan& plan, const HardwareProfile& hw) {
  Report r = plan.program().pipeline() ? detail::simulate_pipeline(plan, hw) : detail::simulate_stage(plan.stages().front(), hw);
  detail::count_gemm_flops(plan.program(), hw, r);
  return r;
}
#endif

}  // namespace partir

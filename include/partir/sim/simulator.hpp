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
  // Per device: the whole step's work is spread over the stages.
  r.compute_seconds /= stages;
  r.communication_seconds /= stages;
  r.flops /= stages;
  r.wire_bytes /= stages;
  for (const auto& st : r.stages) r.bubble_fraction += r.step_seconds > 0 ? 1 - st.busy_seconds / r.step_seconds : 0;
  r.bubble_fraction /= stages;
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
  for (const auto& [dtype, flops] : by_dtype)
    if (flops > by_dtype[r.flops_dtype]) r.flops_dtype = dtype;
  const auto peak = hw.peak_flops.find(r.flops_dtype);
  r.peak_flops = peak == hw.peak_flops.end() ? 0 : peak->second;
}

}  // namespace detail

PARTIR_ENTRY Report simulate(const ExecutionPlan& plan, const HardwareProfile& hw) {
  Report r = plan.program().pipeline() ? detail::simulate_pipeline(plan, hw) : detail::simulate_stage(plan.stages().front(), hw);
  detail::count_gemm_flops(plan.program(), hw, r);
  return r;
}
#endif

}  // namespace partir

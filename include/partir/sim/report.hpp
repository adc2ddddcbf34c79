#pragma once
// Report: what simulate() predicts for one step of an SpmdProgram on one device (every device runs the same
// program on same-sized pieces, so one device speaks for all): the timeline of ops and collectives, the step
// time — with the executor's communication stream, compute and communication on two streams that overlap
// where the program's dependencies let them; without it, serialized — and the peak memory from buffer
// liveness with its breakdown.
// Printable as a table (operator<<) and as JSON (to_json).
#include <algorithm>
#include <array>
#include <cstdio>
#include <ostream>

#include "partir/config.hpp"
#include "partir/sim/json_value.hpp"
#include "partir/spmd/memory_kind.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

struct MemoryBreakdown {
  std::array<std::int64_t, static_cast<std::size_t>(MemoryKind::count_)> bytes{};
  std::int64_t& operator[](MemoryKind k) { return bytes[static_cast<std::size_t>(k)]; }
  std::int64_t operator[](MemoryKind k) const { return bytes[static_cast<std::size_t>(k)]; }
  std::int64_t total() const {
    std::int64_t t = 0;
    for (auto b : bytes) t += b;
    return t;
  }
  friend bool operator==(const MemoryBreakdown&, const MemoryBreakdown&) = default;
};

// One step of the simulated timeline: a local op or a collective.
struct TimedOp {
  ValueId value = -1;
  std::string what;   // op kind, or collective with its axes: all_reduce{batch}
  std::string label;  // the op's name or tag, else %id
  bool communication = false;
  double start = 0, seconds = 0;
  double flops = 0;       // local ops
  double bytes = 0;       // local ops: bytes read and written; collectives: the buffer (S)
  double wire_bytes = 0;  // collectives: bytes each device sends
  std::int64_t group_size = 0;
  std::string bound;      // compute | memory | link | fused (inside a fused chain: computes, moves no bytes)
  std::string reason;     // collectives: why lowering inserted it
  int stage = 0;          // pipelined programs: the stage whose devices run it
};

// One stage of a pipelined step: the time its devices compute and communicate within the stage (busy), the
// time they wait in recvs for other stages (the bubble, and transfers), and their peak memory.
struct StageReport {
  double busy_seconds = 0, wait_seconds = 0, finish_seconds = 0;
  double p2p_bytes = 0;  // sent to other stages
  std::int64_t peak_bytes = 0;
  MemoryBreakdown peak;
  friend bool operator==(const StageReport&, const StageReport&) = default;
};

struct Report {
  std::string program;
  std::string profile;
  Mesh mesh;
  double compute_seconds = 0;
  double communication_seconds = 0;
  double step_seconds = 0;  // serialized: compute + communication; overlapped: when both streams are done
  bool overlap = false;     // communication on its own stream (SimulateOptions::overlap)
  double hidden_communication_seconds = 0;  // overlapped: compute + communication - step
  double flops = 0;         // per device
  // Per device, GEMM and convolution FLOPs (what a peak is quoted for): the model's, remat's recomputation
  // excluded, and the hardware's, included; the peak is the profile's for the dtype that carries most of them.
  double model_flops = 0, hardware_flops = 0, peak_flops = 0;
  DType flops_dtype = DType::f32;
  double wire_bytes = 0;    // per device, all collectives
  std::int64_t peak_bytes = 0;
  ValueId peak_at = -1;     // the op during which the peak occurs (-1: before the first op)
  MemoryBreakdown peak;     // what is resident at the peak
  MemoryBreakdown inputs;   // the inputs, resident for the whole step: the model state a device keeps
  std::int64_t memory_capacity = 0;  // the profile's, 0 if unknown
  std::vector<TimedOp> timeline;
  // Pipelined programs: per stage; the step is the last stage's finish, and the peak the largest stage's.
  std::vector<StageReport> stages;
  // The fraction of the step a stage's devices spend waiting, averaged over stages (GPipe's and 1F1B's bubble
  // is (p - 1) / (M + p - 1) when stages take equal time).
  double bubble_fraction = 0;
  // simulate_repeated: the step's microbatches, replayed from a program of fewer (0: simulated op by op). Such a
  // report keeps no timeline.
  int replayed_microbatches = 0;

  // Model and hardware FLOPs utilization: the FLOPs over what the peak would do in the step (PaLM's MFU).
  double mfu() const { return step_seconds > 0 && peak_flops > 0 ? model_flops / (step_seconds * peak_flops) : 0; }
  double hfu() const { return step_seconds > 0 && peak_flops > 0 ? hardware_flops / (step_seconds * peak_flops) : 0; }
  // The peak fits the device's memory (true where the profile does not know its capacity).
  bool fits() const { return memory_capacity <= 0 || peak_bytes <= memory_capacity; }

  std::vector<const TimedOp*> collectives() const {
    std::vector<const TimedOp*> out;
    for (const auto& t : timeline)
      if (t.communication) out.push_back(&t);
    return out;
  }

  json::Value to_json() const;
};

// Sizes and durations as people read them: 1.50 MiB, 2.345 ms.
inline std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1 << 30) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  else if (b >= 1 << 20) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1 << 20));
  else if (b >= 1 << 10) std::snprintf(buf, sizeof buf, "%.2f KiB", b / (1 << 10));
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}
inline std::string human_seconds(double s) {
  char buf[32];
  if (s >= 1) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  return buf;
}

// A summary, the memory breakdown at the peak, every collective, and the ops that take the most time.
PARTIR_ENTRY std::ostream& operator<<(std::ostream& os, const Report& r);

}  // namespace partir

#if PARTIR_DEFINE_ENTRIES
#include "partir/sim/json.hpp"

namespace partir {

inline std::string time_model(const Report& r) {
  return r.overlap ? "compute and communication on two streams, overlapped" : "compute and communication serialized";
}

PARTIR_ENTRY json::Value Report::to_json() const {
  json::Value breakdown = json::Value::object(), resident = json::Value::object();
  for (std::size_t k = 0; k < peak.bytes.size(); ++k) breakdown[std::string(name_of(MemoryKind(k)))] = peak.bytes[k];
  for (std::size_t k = 0; k < inputs.bytes.size(); ++k)
    if (inputs.bytes[k]) resident[std::string(name_of(MemoryKind(k)))] = inputs.bytes[k];
  json::Value ops = json::Value::array();
  for (const auto& t : timeline) {
    json::Value o = {{"value", t.value}, {"what", t.what}, {"label", t.label}, {"communication", t.communication},
                     {"start_s", t.start}, {"seconds", t.seconds}, {"bound", t.bound}};
    if (t.communication) {
      o.update({{"bytes", t.bytes}, {"wire_bytes", t.wire_bytes}, {"group_size", t.group_size}, {"reason", t.reason}});
    } else {
      o.update({{"flops", t.flops}, {"bytes", t.bytes}});
    }
    ops.push_back(std::move(o));
  }
  json::Value out = {
      {"program", program}, {"profile", profile}, {"mesh", mesh.to_string()},
      {"time_model", time_model(*this)},
      {"step_seconds", step_seconds}, {"compute_seconds", compute_seconds},
      {"communication_seconds", communication_seconds}, {"hidden_communication_seconds", hidden_communication_seconds}, {"flops", flops}, {"wire_bytes", wire_bytes},
      {"collectives", collectives().size()},
      {"utilization", {{"model_flops", model_flops}, {"hardware_flops", hardware_flops}, {"peak_flops", peak_flops},
                       {"dtype", std::string(name_of(flops_dtype))}, {"mfu", mfu()}, {"hfu", hfu()}}},
      {"memory", {{"peak_bytes", peak_bytes}, {"peak_at", peak_at}, {"breakdown", breakdown}, {"inputs", resident},
                  {"capacity", memory_capacity}, {"fits", fits()}}},
      {"timeline", ops}};
  if (!stages.empty()) {
    json::Value list = json::Value::array();
    for (const auto& st : stages)
      list.push_back({{"busy_seconds", st.busy_seconds}, {"wait_seconds", st.wait_seconds},
                      {"finish_seconds", st.finish_seconds}, {"p2p_bytes", st.p2p_bytes},
                      {"peak_bytes", st.peak_bytes}});
    out["pipeline"] = {{"bubble_fraction", bubble_fraction}, {"replayed_microbatches", replayed_microbatches}, {"stages", list}};
  }
  return out;
}

PARTIR_ENTRY std::ostream& operator<<(std::ostream& os, const Report& r) {
  char line[256];
  os << "simulated " << r.program << " on " << r.mesh.to_string() << ", profile " << r.profile << " (per device; "
     << time_model(r) << ")\n";
  if (r.overlap)
    std::snprintf(line, sizeof line, "  step %s: compute %s, communication %s (%s of it hidden); %.3g GFLOP, %s sent\n",
                  human_seconds(r.step_seconds).c_str(), human_seconds(r.compute_seconds).c_str(),
                  human_seconds(r.communication_seconds).c_str(), human_seconds(r.hidden_communication_seconds).c_str(),
                  r.flops / 1e9, human_bytes(r.wire_bytes).c_str());
  else
    std::snprintf(line, sizeof line, "  step %s = compute %s + communication %s; %.3g GFLOP, %s sent\n",
                  human_seconds(r.step_seconds).c_str(), human_seconds(r.compute_seconds).c_str(),
                  human_seconds(r.communication_seconds).c_str(), r.flops / 1e9, human_bytes(r.wire_bytes).c_str());
  os << line;
  if (r.peak_flops > 0 && r.hardware_flops > 0) {
    std::snprintf(line, sizeof line, "  MFU %.1f%%, HFU %.1f%%: %.4g TFLOP of GEMMs (%.4g with recomputation) against %.4g TFLOP/s %s\n",
                  100 * r.mfu(), 100 * r.hfu(), r.model_flops / 1e12, r.hardware_flops / 1e12, r.peak_flops / 1e12,
                  std::string(name_of(r.flops_dtype)).c_str());
    os << line;
  }
  os << "  peak memory " << human_bytes(static_cast<double>(r.peak_bytes));
  if (r.peak_at >= 0) os << " during %" << r.peak_at;
  if (r.memory_capacity > 0) {
    const double used = static_cast<double>(r.peak_bytes) / static_cast<double>(r.memory_capacity);
    std::snprintf(line, sizeof line, " (%s in %s: %.0f%% of it)", r.fits() ? "fits" : "DOES NOT FIT",
                  human_bytes(static_cast<double>(r.memory_capacity)).c_str(), 100 * used);
    os << line;
  }
  os << "\n";
  if (!r.stages.empty()) {
    std::snprintf(line, sizeof line, "  pipeline: %zu stages, bubble %.1f%%", r.stages.size(), 100 * r.bubble_fraction);
    os << line;
    if (r.replayed_microbatches > 0) os << ", " << r.replayed_microbatches << " microbatches replayed from one's tasks";
    os << "\n";
    for (std::size_t s = 0; s < r.stages.size(); ++s) {
      const auto& st = r.stages[s];
      std::snprintf(line, sizeof line, "    stage %zu: busy %s, waiting %s, sends %s, peak %s\n", s,
                    human_seconds(st.busy_seconds).c_str(), human_seconds(st.wait_seconds).c_str(),
                    human_bytes(st.p2p_bytes).c_str(), human_bytes(static_cast<double>(st.peak_bytes)).c_str());
      os << line;
    }
  }
  std::snprintf(line, sizeof line, "    %-20s %12s %12s\n", "", "at peak", "inputs");
  os << line;
  for (std::size_t k = 0; k < r.peak.bytes.size(); ++k) {
    std::snprintf(line, sizeof line, "    %-20s %12s %12s\n", std::string(name_of(MemoryKind(k))).c_str(),
                  human_bytes(static_cast<double>(r.peak.bytes[k])).c_str(),
                  human_bytes(static_cast<double>(r.inputs.bytes[k])).c_str());
    os << line;
  }
  if (r.replayed_microbatches > 0) {
    os << "  (a replayed step keeps no timeline: simulate its program for each op and collective)\n";
    return os;
  }
  const auto collectives = r.collectives();
  os << "  collectives: " << collectives.size() << "\n";
  if (!collectives.empty()) {
    std::snprintf(line, sizeof line, "    %6s  %-30s %5s %12s %12s  %s\n", "value", "collective", "n", "bytes", "time", "reason");
    os << line;
  }
  for (const auto* c : collectives) {
    std::snprintf(line, sizeof line, "    %6s  %-30s %5lld %12s %12s  ", ("%" + std::to_string(c->value)).c_str(),
                  c->what.c_str(), static_cast<long long>(c->group_size), human_bytes(c->bytes).c_str(),
                  human_seconds(c->seconds).c_str());
    os << line << c->reason << "\n";
  }
  std::vector<const TimedOp*> local;
  for (const auto& t : r.timeline)
    if (!t.communication) local.push_back(&t);
  std::stable_sort(local.begin(), local.end(), [](auto* a, auto* b) { return a->seconds > b->seconds; });
  local.resize(std::min<std::size_t>(local.size(), 10));
  os << "  slowest local ops:\n";
  std::snprintf(line, sizeof line, "    %6s  %-18s %-28s %12s %10s %12s  %s\n", "value", "op", "name", "time", "GFLOP", "bytes", "bound");
  os << line;
  for (const auto* t : local) {
    std::snprintf(line, sizeof line, "    %6s  %-18s %-28s %12s %10.3g %12s  %s\n", ("%" + std::to_string(t->value)).c_str(),
                  t->what.c_str(), t->label.substr(0, 28).c_str(), human_seconds(t->seconds).c_str(), t->flops / 1e9,
                  human_bytes(t->bytes).c_str(), t->bound.c_str());
    os << line;
  }
  return os;
}

}  // namespace partir
#endif

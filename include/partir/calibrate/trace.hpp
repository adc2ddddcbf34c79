#pragma once
// Timelines as Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one process per device, one
// track for compute and one for communication. The simulator's Report converts to it; anything that times
// real ops (an executor, a benchmark) can emit the same events, so predicted and measured timelines open
// side by side.
#include "partir/runtime/exec/executor.hpp"
#include "partir/sim/json.hpp"
#include "partir/sim/report.hpp"
#include "partir/sim/simulator.hpp"

namespace partir {

struct TraceEvent {
  std::string name;
  std::string category;  // "compute" | "communication": also picks the track
  std::int64_t device = 0;
  double start = 0, seconds = 0;
  json::Value args = json::Value::object();
};

inline json::Value chrome_trace(const std::vector<TraceEvent>& events, std::string_view title) {
  json::Value list = json::Value::array();
  std::vector<std::int64_t> devices;
  for (const auto& e : events)
    if (std::find(devices.begin(), devices.end(), e.device) == devices.end()) devices.push_back(e.device);
  for (auto d : devices) {
    list.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", d},
                    {"args", {{"name", std::string(title) + " device " + std::to_string(d)}}}});
    for (int track = 0; track < 2; ++track)
      list.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", d}, {"tid", track},
                      {"args", {{"name", track ? "communication" : "compute"}}}});
  }
  for (const auto& e : events)
    list.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"pid", e.device},
                    {"tid", e.category == "communication" ? 1 : 0}, {"ts", e.start * 1e6}, {"dur", e.seconds * 1e6},
                    {"args", e.args}});
  return {{"displayTimeUnit", "ms"}, {"traceEvents", list}};
}

// The simulated step on `devices` devices (every device runs the same timeline; more than a few tracks
// add nothing but size).
// A pipelined step has one track per stage instead (the familiar pipeline diagram).
inline std::vector<TraceEvent> trace_events(const Report& r, std::int64_t devices = 1) {
  std::vector<TraceEvent> out;
  const bool pipelined = !r.stages.empty();
  for (std::int64_t d = 0; d < (pipelined ? 1 : devices); ++d)
    for (const auto& t : r.timeline) {
      json::Value args = {{"value", "%" + std::to_string(t.value)}, {"bound", t.bound}, {"bytes", t.bytes}};
      if (t.communication) args.update({{"group_size", t.group_size}, {"reason", t.reason}});
      else args["flops"] = t.flops;
      out.push_back({t.what + " " + t.label, t.communication ? "communication" : "compute", pipelined ? t.stage : d,
                     t.start, t.seconds, std::move(args)});
    }
  return out;
}

// What one device's execute() measured (ExecuteOptions::timeline), named as the simulator names ops.
inline std::vector<TraceEvent> trace_events(const SpmdProgram& p, const std::vector<OpTiming>& timeline,
                                            std::int64_t device) {
  std::vector<TraceEvent> out;
  for (const auto& t : timeline) {
    const SpmdOp& s = p.op(t.value);
    out.push_back({timeline_what(s) + " " + timeline_label(s, t.value), s.communicates() ? "communication" : "compute",
                   device, t.start, t.seconds, {{"value", "%" + std::to_string(t.value)}}});
  }
  return out;
}

inline json::Value chrome_trace(const Report& r, std::int64_t devices = 1) {
  return chrome_trace(trace_events(r, devices), "simulated " + r.program);
}

}  // namespace partir

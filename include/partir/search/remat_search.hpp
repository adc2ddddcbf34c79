#pragma once
// choose_remat: which rematerialization policy a step needs under a per-device memory budget. Each candidate
// (none, selective, blocks by default) is applied to the step, partitioned by the schedule (which may itself
// search: auto tactics), lowered and simulated; the fastest predicted step whose predicted peak fits the
// budget wins. The report lists every candidate with its predicted time, peak and FLOPs, so the cost of the
// memory saved is plain. A search over remat next to the automatic tactic's search over tilings, not inside
// it: remat changes the program, tilings only its layouts.
#include <sstream>

#include "partir/autodiff/remat.hpp"
#include "partir/sim/simulator.hpp"
#include "partir/spmd/lower.hpp"
#include "partir/tactics/partition.hpp"

namespace partir {

struct RematCandidate {
  Remat remat;
  double step_seconds = 0, flops = 0;  // predicted, per device
  std::int64_t peak_bytes = 0;
  bool fits = false;
};

struct RematChoice {
  Remat remat;
  Program step;  // rematerialized
  std::vector<RematCandidate> candidates;
  std::string report() const {
    std::ostringstream os;
    os << "remat search: chose '" << remat.name << "'\n";
    for (const auto& c : candidates)
      os << "  " << c.remat.name << ": step " << human_seconds(c.step_seconds) << ", peak "
         << human_bytes(static_cast<double>(c.peak_bytes)) << ", " << c.flops / 1e9 << " GFLOP per device"
         << (c.fits ? "" : " (over the budget)") << "\n";
    return os.str();
  }
};

inline RematChoice choose_remat(const Program& step, const Mesh& mesh, const Schedule& schedule,
                                const HardwareProfile& profile, std::int64_t memory_budget_bytes,
                                std::vector<Remat> candidates = {Remat::none(), Remat::selective(), Remat::blocks()}) {
  if (memory_budget_bytes <= 0)
    user_error("choose_remat: memory_budget_bytes " + std::to_string(memory_budget_bytes) + " (a budget is > 0 bytes)");
  RematChoice out;
  int best = -1;
  for (const auto& r : candidates) {
    Program s = rematerialize(step, r);
    const Report predicted = simulate(lower(partition(s, mesh, schedule)), profile);
    out.candidates.push_back({r, predicted.step_seconds, predicted.flops, predicted.peak_bytes,
                              predicted.peak_bytes <= memory_budget_bytes});
    const auto& c = out.candidates.back();
    if (c.fits && (best < 0 || c.step_seconds < out.candidates[static_cast<std::size_t>(best)].step_seconds)) {
      best = static_cast<int>(out.candidates.size() - 1);
      out.step = std::move(s);
    }
  }
  if (best < 0) {
    std::int64_t least = out.candidates.front().peak_bytes;
    for (const auto& c : out.candidates) least = std::min(least, c.peak_bytes);
    user_error("choose_remat: no policy fits the budget of " + human_bytes(static_cast<double>(memory_budget_bytes)) +
               " per device; the smallest predicted peak is " + human_bytes(static_cast<double>(least)));
  }
  out.remat = out.candidates[static_cast<std::size_t>(best)].remat;
  return out;
}

}  // namespace partir

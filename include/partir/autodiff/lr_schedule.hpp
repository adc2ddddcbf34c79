#pragma once
// Learning-rate schedules: the factor by which each step scales the optimizer's learning rate, computed on
// the host and fed to the step as its "opt/lr_scale" input (StepOptions::scheduled_learning_rate), so the
// program is built and partitioned once, and a checkpoint's step number is the schedule's position.
//
// A schedule is phases run one after another, each moving the factor from `from` to `to` over `steps`
// steps, linearly or along a half cosine; after the last phase the factor stays at its `to` (1 with no
// phases). Step t counts from 0 for the first step, as torch.optim.lr_scheduler.LambdaLR's lambda sees it:
//   LRSchedule::warmup(100).then_cosine(900, 0.1)   (t+1)/101 for t < 100, then cosine from 1 to 0.1
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "partir/error.hpp"
#include "partir/ir/printer.hpp"

namespace partir {

struct LRPhase {
  enum class Shape : std::uint8_t { linear, cosine } shape = Shape::linear;
  long steps = 0;
  double from = 1, to = 1;
  friend bool operator==(const LRPhase&, const LRPhase&) = default;
};

struct LRSchedule {
  std::vector<LRPhase> phases;

  static LRSchedule constant() { return {}; }
  // Linear warmup (torchtitan's): (t + 1) / (steps + 1) for t < steps, so the first step already moves.
  static LRSchedule warmup(long steps) { return LRSchedule{}.then({LRPhase::Shape::linear, steps, 1.0 / static_cast<double>(steps + 1), 1}); }
  // From the current factor down to final_scale over `steps` steps.
  LRSchedule then_cosine(long steps, double final_scale = 0) const { return then({LRPhase::Shape::cosine, steps, end(), final_scale}); }
  LRSchedule then_linear(long steps, double final_scale = 0) const { return then({LRPhase::Shape::linear, steps, end(), final_scale}); }
  LRSchedule then(LRPhase phase) const {
    if (phase.steps < 1) user_error("LRSchedule: a phase of " + std::to_string(phase.steps) + " steps (a phase lasts >= 1 step)");
    if (!(phase.from >= 0) || !(phase.to >= 0))
      user_error("LRSchedule: a phase from " + detail::number_str(phase.from) + " to " + detail::number_str(phase.to) +
                 " (learning-rate factors are >= 0)");
    LRSchedule out = *this;
    out.phases.push_back(phase);
    return out;
  }

  // The factor of step t (0-based).
  double at(long t) const {
    for (const auto& p : phases) {
      if (t >= p.steps) {
        t -= p.steps;
        continue;
      }
      const double x = static_cast<double>(t) / static_cast<double>(p.steps);
      if (p.shape == LRPhase::Shape::linear) return p.from + (p.to - p.from) * x;
      return p.to + (p.from - p.to) * 0.5 * (1 + std::cos(std::numbers::pi * x));
    }
    return end();
  }

  long steps() const {
    long n = 0;
    for (const auto& p : phases) n += p.steps;
    return n;
  }

  // The examples' --lr-schedule: constant, warmup (then constant), cosine, linear, warmup_cosine or
  // warmup_linear, decaying to final_scale at the last of total_steps. `source` names the flag in errors.
  static LRSchedule parse(const std::string& name, long warmup_steps, long total_steps, double final_scale,
                          const std::string& source) {
    const bool warm = name.starts_with("warmup");
    const std::string decay = warm ? (name.size() > 6 && name[6] == '_' ? name.substr(7) : name.substr(6)) : name;
    if (name != "constant" && decay != "" && decay != "cosine" && decay != "linear")
      user_error(source + ": unknown schedule '" + name +
                 "' (expected constant, warmup, cosine, linear, warmup_cosine or warmup_linear)");
    if (!warm && warmup_steps != 0)
      user_error(source + " " + name + ": a warmup of " + std::to_string(warmup_steps) +
                 " steps needs a warmup schedule (warmup, warmup_cosine or warmup_linear)");
    if (warm && warmup_steps < 1) user_error(source + " " + name + ": --warmup " + std::to_string(warmup_steps) + " (needs >= 1 step)");
    if (warm && warmup_steps >= total_steps)
      user_error(source + " " + name + ": warmup of " + std::to_string(warmup_steps) + " steps is not shorter than the run (" +
                 std::to_string(total_steps) + " steps)");
    if (!(final_scale >= 0 && final_scale <= 1))
      user_error(source + ": final scale " + detail::number_str(final_scale) + " (expected 0 <= scale <= 1)");
    LRSchedule s = warm ? warmup(warmup_steps) : constant();
    const long left = total_steps - (warm ? warmup_steps : 0);
    if (decay == "cosine") return s.then_cosine(left, final_scale);
    if (decay == "linear") return s.then_linear(left, final_scale);
    return s;
  }

  friend bool operator==(const LRSchedule&, const LRSchedule&) = default;

 private:
  double end() const { return phases.empty() ? 1 : phases.back().to; }
};

}  // namespace partir

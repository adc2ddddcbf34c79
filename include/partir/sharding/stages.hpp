#pragma once
// PipelineStages: which stage of a pipeline axis computes each value of a program. A pipeline tactic
// (tactics/pipeline.hpp) sets it on the partition state; lowering (spmd/pipeline.hpp) cuts the SPMD program
// at the stage boundaries. Values without a stage of their own (data, constants, what only they make) are
// computed on every stage that uses them.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace partir {

enum class PipelineSchedule : std::uint8_t { gpipe, one_f_one_b };

inline std::string_view name_of(PipelineSchedule s) { return s == PipelineSchedule::gpipe ? "gpipe" : "1f1b"; }

struct PipelineStages {
  std::string axis;  // the mesh axis whose positions are the stages
  int stages = 1;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int tactic = -1;          // the schedule index of the tactic that set it (provenance)
  std::string tactic_label; // "tactic 1 (pp(stage))"
  std::vector<int> stage;   // per value: its stage, -1 if it has none of its own
  friend bool operator==(const PipelineStages&, const PipelineStages&) = default;
};

}  // namespace partir

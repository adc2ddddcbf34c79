#pragma once
// The examples' --schedule flag as a Schedule: the presets by their short names, and "auto:<axis>", the
// automatic search, which is why this lives above the simulator (search/) and presets.hpp does not.
#include <charconv>
#include <string_view>

#include "partir/search/automatic.hpp"
#include "partir/tactics/presets.hpp"

namespace partir {

// "bp,mp,z3" with BP and ZeRO on `batch_axis`, MP, EMB and MQ on `model_axis`, EP on `expert_axis`, SP on
// `spatial_axis` and PP on `stage_axis` (1F1B; pp:gpipe, pp:interleaved:<v>, pp:zb1, pp:zbv: sharding/stages.hpp)
// (the examples' --schedule flag). "auto:<axis>" (or "auto", on `model_axis`) is an AutomaticPartition with default settings whose
// `report` is set, so a caller can print what it chose.
PARTIR_ENTRY Schedule parse_schedule(std::string_view text, const std::string& batch_axis = "batch",
                               const std::string& model_axis = "model", const std::string& stage_axis = "stage",
                               const std::string& expert_axis = "expert", const std::string& spatial_axis = "space");

#if PARTIR_DEFINE_ENTRIES
PARTIR_ENTRY Schedule parse_schedule(std::string_view text, const std::string& batch_axis,
                               const std::string& model_axis, const std::string& stage_axis,
                               const std::string& expert_axis, const std::string& spatial_axis) {
  Schedule out;
  std::size_t start = 0;
  while (start < text.size()) {
    const auto end = std::min(text.find(',', start), text.size());
    const auto item = text.substr(start, end - start);
    if (item == "bp") out.push_back(data_parallel(batch_axis));
    else if (item == "mp") out.push_back(megatron(model_axis));
    else if (item == "z2") out.push_back(zero2(batch_axis));
    else if (item == "z3") out.push_back(zero3(batch_axis));
    else if (item == "emb") out.push_back(embedding(model_axis));
    else if (item == "pp" || item == "pp:1f1b") out.push_back(pipeline(stage_axis));
    else if (item == "pp:gpipe") out.push_back(pipeline(stage_axis, PipelineSchedule::gpipe));
    else if (item == "pp:zb1") out.push_back(pipeline(stage_axis, PipelineSchedule::zb1));
    else if (item == "pp:zbv") out.push_back(pipeline(stage_axis, PipelineSchedule::zbv));
    else if (item.starts_with("pp:interleaved:")) {
      int v = 0;
      const auto digits = item.substr(15);
      const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
      if (error != std::errc{} || end != digits.data() + digits.size() || v < 1)
        user_error("schedule '" + std::string(text) + "': '" + std::string(item) +
                   "' needs a chunk count of at least 1, as in pp:interleaved:2");
      out.push_back(pipeline(stage_axis, PipelineSchedule::interleaved(v)));
    }
    else if (item == "mq") out.push_back(multi_query(model_axis));
    else if (item == "ep") out.push_back(expert_parallel(expert_axis));
    else if (item == "sp") out.push_back(spatial(spatial_axis));
    else if (item == "auto" || item.starts_with("auto:")) {
      const std::string axis = item == "auto" ? model_axis : std::string(item.substr(5));
      if (axis.empty()) user_error("schedule '" + std::string(text) + "': 'auto:' needs an axis, as in auto:model");
      out.push_back(AutomaticPartition{{axis}, Objective::step_time, 0, {}, HardwareProfile::cpu(), {},
                                       std::make_shared<SearchReport>()});
    }
    else if (item != "none")
      user_error("schedule '" + std::string(text) + "': unknown tactic '" + std::string(item) +
                 "' (expected none, bp, mp, z2, z3, emb, mq, ep, sp, pp, pp:gpipe, pp:interleaved:<v>, pp:zb1, pp:zbv, "
                 "auto:<axis>)");
    start = end + 1;
  }
  return out;
}
#endif

}  // namespace partir

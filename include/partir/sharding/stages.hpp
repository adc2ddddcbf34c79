#pragma once
// PipelineStages: which stage of a pipeline axis computes each value of a program. A pipeline tactic
// (tactics/pipeline.hpp) sets it on the partition state; lowering (spmd/pipeline.hpp) cuts the SPMD program
// at the stage boundaries. Values without a stage of their own (data, constants, what only they make) are
// computed on every stage that uses them.
//
// PipelineSchedule is a value, as Halide's and TACO's schedules are: the order of each stage's tasks, and how
// many model chunks (virtual stages) each device holds.
//   gpipe             all forward passes, then all backward passes (GPipe)
//   one_f_one_b       p - 1 - s forward passes, then one forward and one backward alternately (PipeDream-Flush)
//   interleaved(v)    1F1B over v chunks per device, layers dealt round-robin: chunk c on device c % p
//                     (Megatron-LM's interleaved schedule; bubble (p - 1) / (v M))
//   zb1               1F1B with the backward split into B (the input gradient) and W (the weight gradients),
//                     W run in the bubbles (ZB-H1, Qi et al. 2024: 1F1B's activation memory)
//   zbv               zb1 over 2 chunks per device placed as a V: chunk c on device c, chunk 2p - 1 - c on
//                     device c (ZB-V), so the first and the last chunk share device 0
#include <cstdint>
#include <string>
#include <vector>

namespace partir {

struct PipelineSchedule {
  enum class Order : std::uint8_t { gpipe, one_f_one_b, zero_bubble };
  Order order = Order::one_f_one_b;
  int chunks = 1;        // model chunks (virtual stages) per device
  bool v_shape = false;  // chunks placed down and back up the devices (zbv), not round-robin

  static const PipelineSchedule gpipe, one_f_one_b, zb1, zbv;
  static PipelineSchedule interleaved(int chunks) { return {Order::one_f_one_b, chunks, false}; }

  bool splits_backward() const { return order == Order::zero_bubble; }
  // The device of virtual stage c (of p devices).
  int device_of(int c, int p) const { return v_shape ? (c < p ? c : 2 * p - 1 - c) : c % p; }
  friend bool operator==(const PipelineSchedule&, const PipelineSchedule&) = default;
};
inline const PipelineSchedule PipelineSchedule::gpipe{Order::gpipe, 1, false};
inline const PipelineSchedule PipelineSchedule::one_f_one_b{Order::one_f_one_b, 1, false};
inline const PipelineSchedule PipelineSchedule::zb1{Order::zero_bubble, 1, false};
inline const PipelineSchedule PipelineSchedule::zbv{Order::zero_bubble, 2, true};

// "gpipe", "1f1b", "interleaved:2", "zb1", "zbv" (the --schedule flag's pp:<name>).
inline std::string name_of(const PipelineSchedule& s) {
  if (s == PipelineSchedule::gpipe) return "gpipe";
  if (s == PipelineSchedule::zb1) return "zb1";
  if (s == PipelineSchedule::zbv) return "zbv";
  if (s.order == PipelineSchedule::Order::one_f_one_b && !s.v_shape)
    return s.chunks == 1 ? "1f1b" : "interleaved:" + std::to_string(s.chunks);
  return std::string(s.order == PipelineSchedule::Order::gpipe ? "gpipe" : s.order == PipelineSchedule::Order::zero_bubble ? "zb" : "1f1b") +
         (s.v_shape ? ":v" : ":") + std::to_string(s.chunks);
}

struct PipelineStages {
  std::string axis;  // the mesh axis whose positions are the stages
  int stages = 1;
  PipelineSchedule schedule;
  int tactic = -1;          // the schedule index of the tactic that set it (provenance)
  std::string tactic_label; // "tactic 1 (pp(stage))"
  std::vector<int> stage;   // per value: the device position that computes it, -1 if it has none of its own
  std::vector<int> chunk;   // per value: its virtual stage (0 .. stages * chunks - 1; the stage when chunks is 1)
  std::vector<std::string> cut;  // per virtual stage, the layers the tactic gave it and why ("layers 0-2, 31% of
                                 // the predicted work"); empty where selectors chose
  friend bool operator==(const PipelineStages&, const PipelineStages&) = default;
};

}  // namespace partir

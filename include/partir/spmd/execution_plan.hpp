#pragma once
// ExecutionPlan: everything that running an SpmdProgram needs besides kernels and a communicator, derived once
// from the program and its options: per pipeline stage the program its devices run (the whole program without a
// pipeline), its elementwise fusion groups (fusion.hpp), when each buffer dies (the groups' last uses), which
// inputs a step may free early (donated state), what each buffer holds (MemoryKind) and the stream policy (which
// collectives run on the communication stream). The executor (runtime/exec), the simulator (sim/) and the GPU
// pool all read one plan, so what is predicted and what runs come from the same frees by construction;
// Executable builds its plan at compile time and reuses it every step.
//
// Stream policy: $PARTIR_ASYNC unset or 1 streams collectives of 256 KiB and more; `all` streams every
// collective (the tests use it to drive the stream with small programs); 0 runs every collective inline,
// blocking, where the program places it. set_async_collectives() sets the same for a process.
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include "partir/config.hpp"
#include "partir/spmd/fusion.hpp"
#include "partir/spmd/memory_kind.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

inline constexpr std::int64_t default_stream_min_bytes = 256 << 10;

namespace detail {
struct AsyncSetting {
  std::atomic<bool> on;
  std::atomic<std::int64_t> min_bytes;
};
inline AsyncSetting& async_setting() {
  static AsyncSetting setting = [] {
    const char* v = std::getenv("PARTIR_ASYNC");
    const std::string mode = v ? v : "1";
    if (mode != "0" && mode != "1" && mode != "all")
      user_error("PARTIR_ASYNC: expected 0 (collectives inline), 1 (streamed from 256 KiB) or all (every collective "
                 "streamed), got '" + mode + "'");
    return AsyncSetting{mode != "0", mode == "all" ? 0 : default_stream_min_bytes};
  }();
  return setting;
}
}  // namespace detail

inline bool async_collectives_enabled() { return detail::async_setting().on; }
inline std::int64_t stream_min_bytes() { return detail::async_setting().min_bytes; }
// The defaults of PlanOptions (execution and simulation), for plans made afterwards.
inline void set_async_collectives(bool on, std::int64_t min_bytes = default_stream_min_bytes) {
  detail::async_setting().on = on;
  detail::async_setting().min_bytes = min_bytes;
}

struct PlanOptions {
  // Communication on its own stream, overlapping compute, for collectives of stream_min_bytes or more and those
  // issued while the stream is busy. A pipelined program's stages never stream: their transfers already leave
  // the sender free.
  bool overlap = async_collectives_enabled();
  std::int64_t stream_min_bytes = partir::stream_min_bytes();
  // The step consumes the state its outputs replace (Executable::step): each such input is freed after its last
  // use instead of held to the end.
  bool donate_state = false;
  // Elementwise chains run as fused groups; false for a device that runs every op by itself (the GPU's today).
  bool fuse = fusion_enabled();
  friend bool operator==(const PlanOptions&, const PlanOptions&) = default;
};

// What the devices of one pipeline stage run (stage 0, the whole program, without a pipeline).
struct StagePlan {
  int stage = 0;
  std::shared_ptr<const SpmdProgram> program;
  std::vector<ValueId> ids;  // the pipelined program's id of each of this program's values (empty: the same)
  FusionPlan fusion;
  std::vector<bool> donated;  // inputs freed after their last use
  std::vector<MemoryKind> kinds;
  bool overlap = false;
  std::int64_t stream_min_bytes = 0;

  // frees()[v]: the values whose buffers die once v has run (a group's inputs at its root; inner values never
  // get one).
  const std::vector<std::vector<ValueId>>& frees() const { return fusion.last_uses(); }
  ValueId original(ValueId v) const { return ids.empty() ? v : ids[static_cast<std::size_t>(v)]; }
  // The stream policy: a collective goes on the communication stream when overlap is on and it is large or the
  // stream is busy (a small one queues behind the others, so every device runs collectives in program order).
  bool streamed(ValueId v, bool stream_busy) const {
    const SpmdOp& s = program->op(v);
    if (!overlap || !s.communicates()) return false;
    return stream_busy || std::max(s.op.type.bytes(), program->type(s.op.operands.at(0)).bytes()) >= stream_min_bytes;
  }
};

class ExecutionPlan {
 public:
  explicit ExecutionPlan(SpmdProgram p, const PlanOptions& options = {})
      : ExecutionPlan(std::make_shared<const SpmdProgram>(std::move(p)), options) {}
  ExecutionPlan(std::shared_ptr<const SpmdProgram> p, const PlanOptions& options);
  // A plan over a program the caller keeps alive for the plan's lifetime (simulate(), execute() of one run).
  static ExecutionPlan borrowing(const SpmdProgram& p, const PlanOptions& options = {}) {
    return {std::shared_ptr<const SpmdProgram>(std::shared_ptr<const SpmdProgram>(), &p), options};
  }

  const SpmdProgram& program() const { return *program_; }
  const PlanOptions& options() const { return options_; }
  // One per pipeline stage (one without a pipeline).
  const std::vector<StagePlan>& stages() const { return stages_; }
  const StagePlan& stage_for(std::int64_t device) const {
    return stages_[static_cast<std::size_t>(program_->stage_of(device))];
  }

 private:
  std::shared_ptr<const SpmdProgram> program_;
  PlanOptions options_;
  std::vector<StagePlan> stages_;
};

#if PARTIR_DEFINE_ENTRIES
namespace detail {
inline StagePlan plan_stage(std::shared_ptr<const SpmdProgram> program, int stage, std::vector<ValueId> ids,
                            const PlanOptions& options, bool overlap) {
  FusionPlan fusion = plan_fusion(*program, options.fuse);
  std::vector<bool> donated =
      options.donate_state ? updated_inputs(*program) : std::vector<bool>(static_cast<std::size_t>(program->size()));
  std::vector<MemoryKind> kinds = memory_kinds(*program);
  return {stage,           std::move(program), std::move(ids), std::move(fusion), std::move(donated), std::move(kinds),
          overlap, options.stream_min_bytes};
}
}  // namespace detail

PARTIR_ENTRY ExecutionPlan::ExecutionPlan(std::shared_ptr<const SpmdProgram> p, const PlanOptions& options)
    : program_(std::move(p)), options_(options) {
  if (!program_->pipeline()) {
    stages_.push_back(detail::plan_stage(program_, 0, {}, options, options.overlap));
    return;
  }
  for (int s = 0; s < program_->pipeline()->stages; ++s) {
    std::vector<ValueId> ids;
    auto stage = std::make_shared<const SpmdProgram>(stage_program(*program_, s, &ids));
    stages_.push_back(detail::plan_stage(std::move(stage), s, std::move(ids), options, /*overlap=*/false));
  }
}
#endif

}  // namespace partir

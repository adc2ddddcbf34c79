#pragma once
// cut_into_stages: the last step of lowering a pipelined plan (tactics/pipeline.hpp). Every op of the lowered
// program gets the stage its global value was given; an op with no stage of its own is copied onto each stage
// that reads it; a value read on another stage than its own is sent there once, right after it is made, and
// received right before its first use there (a send/recv pair with one tag); a plain output (the loss) is sent
// to every stage, so every device returns it. Each stage's ops are then ordered by the schedule: its tasks
// (microbatch m's forward or backward pass, then the update) in GPipe or 1F1B order, each task's ops in
// program order. The stages' sequences are interleaved into one program by running them as the devices will
// (sends never wait, a recv waits for its send): if that stalls, the stages wait on each other in a cycle and
// the plan is refused.
#include <algorithm>
#include <map>
#include <set>

#include "partir/config.hpp"
#include "partir/ir/program.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

// `lowered` (with `source`: each lowered op's value of `prog`) cut into `stages` as above; a schedule whose
// stages would wait on each other in a cycle is a UserError.
PARTIR_ENTRY SpmdProgram cut_into_stages(SpmdProgram lowered, const std::vector<ValueId>& source, const Program& prog,
                                         const PipelineStages& stages);

#if PARTIR_DEFINE_ENTRIES
namespace detail {

struct StageTask {
  Segment::Pass pass = Segment::Pass::forward;
  int microbatch = 0;
  friend auto operator<=>(const StageTask&, const StageTask&) = default;
};

// The order stage s of p runs its tasks in, for M microbatches.
inline std::vector<StageTask> stage_tasks(PipelineSchedule schedule, int s, int p, int m) {
  using P = Segment::Pass;
  std::vector<StageTask> out;
  if (schedule == PipelineSchedule::gpipe) {
    for (int j = 0; j < m; ++j) out.push_back({P::forward, j});
    for (int j = 0; j < m; ++j) out.push_back({P::backward, j});
  } else {
    const int warmup = std::min(m, p - 1 - s);
    for (int j = 0; j < warmup; ++j) out.push_back({P::forward, j});
    for (int j = 0; j < m; ++j) {
      if (warmup + j < m) out.push_back({P::forward, warmup + j});
      out.push_back({P::backward, j});
    }
  }
  out.push_back({P::update, 0});
  return out;
}

// The task of each global value: the segment it lies in (a program without segments is one forward pass).
inline std::vector<StageTask> tasks_of(const Program& prog) {
  std::vector<StageTask> out(static_cast<std::size_t>(prog.size()));
  auto seg = prog.segments().begin();
  StageTask current;
  for (ValueId v = 0; v < prog.size(); ++v) {
    for (; seg != prog.segments().end() && seg->begin <= v; ++seg) current = {seg->pass, seg->microbatch};
    out[static_cast<std::size_t>(v)] = current;
  }
  return out;
}

class StageCutter {
 public:
  StageCutter(SpmdProgram lowered, const std::vector<ValueId>& source, const Program& prog, const PipelineStages& st)
      : in_(std::move(lowered)), source_(source), prog_(prog), st_(st), tasks_(tasks_of(prog)),
        stage_(in_.size()), needs_(static_cast<std::size_t>(in_.size())),
        local_(static_cast<std::size_t>(st.stages), std::vector<int>(static_cast<std::size_t>(in_.size()), -1)),
        order_(static_cast<std::size_t>(st.stages)) {
    for (ValueId v = 0; v < in_.size(); ++v) stage_[static_cast<std::size_t>(v)] = in_.op(v).stage;
    // A plain output no stage makes (a constant) is made on stage 0, and sent from there like the others.
    for (const auto& b : in_.outputs())
      if (stage_[static_cast<std::size_t>(b.value)] < 0 && !is_input(b.value)) stage_[static_cast<std::size_t>(b.value)] = 0;
    for (const auto& s : prog.segments()) microbatches_ = std::max(microbatches_, s.microbatch + 1);
  }

  SpmdProgram run() {
    find_needs();
    for (int s = 0; s < st_.stages; ++s) sequence(s);
    return interleave();
  }

 private:
  struct Node {
    SpmdOp op;       // operands: node ids
    int stage = -1;
    ValueId of = -1;  // the lowered value it computes, moves or copies
  };

  bool is_input(ValueId v) const { return in_.op(v).op.kind == OpKind::input && !in_.op(v).collective; }
  int stage(ValueId v) const { return stage_[static_cast<std::size_t>(v)]; }
  StageTask task(ValueId v) const { return tasks_[static_cast<std::size_t>(source_[static_cast<std::size_t>(v)])]; }

  // The stages that run each stage-less op (the stages of the ops that read it), and for each value the
  // other stages that read it (its sends).
  void find_needs() {
    const auto n = static_cast<std::size_t>(in_.size());
    std::vector<std::set<int>> runs_on(n);
    for (ValueId v = 0; v < in_.size(); ++v)
      if (stage(v) >= 0 && !is_input(v)) runs_on[static_cast<std::size_t>(v)].insert(stage(v));
    for (const auto& b : in_.outputs()) {
      const Binding* updated = nullptr;
      for (const auto& i : in_.inputs()) updated = i.name == b.updates ? &i : updated;
      const bool state = updated && stage(updated->value) >= 0;
      for (int s = 0; s < st_.stages; ++s)
        if (!state || s == stage(updated->value)) outputs_on_[s].push_back(&b - in_.outputs().data());
    }
    for (const auto& [s, list] : outputs_on_)
      for (auto i : list) {
        const ValueId v = in_.outputs()[static_cast<std::size_t>(i)].value;
        if (stage(v) < 0) runs_on[static_cast<std::size_t>(v)].insert(s);
      }
    for (auto v = n; v-- > 0;)
      for (ValueId o : in_.op(static_cast<ValueId>(v)).op.operands)
        if (stage(o) < 0 && !is_input(o)) runs_on[static_cast<std::size_t>(o)].insert(runs_on[v].begin(), runs_on[v].end());
    auto need = [&](ValueId o, int s) {
      if (stage(o) >= 0 && stage(o) != s) needs_[static_cast<std::size_t>(o)].insert(s);
    };
    for (ValueId v = 0; v < in_.size(); ++v)
      for (int s : runs_on[static_cast<std::size_t>(v)])
        for (ValueId o : in_.op(v).op.operands) need(o, s);
    for (const auto& [s, list] : outputs_on_)
      for (auto i : list) need(in_.outputs()[static_cast<std::size_t>(i)].value, s);
  }

  int add(Node node) {
    nodes_.push_back(std::move(node));
    return static_cast<int>(nodes_.size()) - 1;
  }

  // The send of v to stage t (made once, placed on v's stage right after v).
  int send_of(ValueId v, int t) {
    auto [it, fresh] = sends_.try_emplace({v, t}, -1);
    if (fresh) {
      SpmdOp s{Op{OpKind::input, {}, {}, in_.type(v), ""},
               Collective{CollectiveKind::send, {st_.axis}, -1, -1, reason(v, stage(v), t), t,
                          static_cast<std::int64_t>(sends_.size() - 1)},
               {}, stage(v)};
      it->second = add({std::move(s), stage(v), v});
    }
    return it->second;
  }

  std::string reason(ValueId v, int from, int to) const {
    const ValueId g = source_[static_cast<std::size_t>(v)];
    return st_.tactic_label + ": " + prog_.label(g) + " " + to_string(prog_.type(g)) + " from stage " +
           std::to_string(from) + " to stage " + std::to_string(to) + " (" + (to > from ? "forward" : "backward") +
           " across the stage boundary)";
  }

  void place(int s, int node) { order_[static_cast<std::size_t>(s)].push_back(node); }

  // Right after v is made on its stage s (as `node`): its sends to the other stages that read it.
  void send_everywhere(int s, ValueId v, int node) {
    for (int t : needs_[static_cast<std::size_t>(v)]) {
      const int send = send_of(v, t);
      nodes_[static_cast<std::size_t>(send)].op.op.operands = {node};
      place(s, send);
    }
  }

  // The node holding lowered value v on stage s, made (with what it reads) if it is not there yet.
  int on(int s, ValueId v) {
    int& slot = local_[static_cast<std::size_t>(s)][static_cast<std::size_t>(v)];
    if (slot >= 0) return slot;
    if (is_input(v)) {
      if (stage(v) < 0 || stage(v) == s) return slot = input_node(v);
    } else if (stage(v) < 0 || stage(v) == s) {
      Node node{in_.op(v), s, v};
      for (auto& o : node.op.op.operands) o = on(s, o);
      node.op.stage = s;
      slot = add(std::move(node));
      place(s, slot);
      send_everywhere(s, v, slot);
      return slot;
    }
    // Made on another stage: received here, before its first use.
    const int send = send_of(v, s);
    SpmdOp r{Op{OpKind::input, {send}, {}, in_.type(v), ""},
             Collective{CollectiveKind::recv, {st_.axis}, -1, -1, reason(v, stage(v), s), stage(v),
                        nodes_[static_cast<std::size_t>(send)].op.collective->tag},
             {}, s};
    slot = add({std::move(r), s, v});
    place(s, slot);
    return slot;
  }

  int input_node(ValueId v) {
    auto [it, fresh] = inputs_.try_emplace(v, -1);
    if (fresh) {
      SpmdOp op = in_.op(v);
      op.stage = stage(v);
      it->second = add({std::move(op), stage(v), v});
    }
    return it->second;
  }

  void sequence(int s) {
    // A stage's state inputs that other stages read (a tied embedding) go out first.
    for (const auto& b : in_.inputs())
      if (stage(b.value) == s) send_everywhere(s, b.value, on(s, b.value));
    std::map<StageTask, std::vector<ValueId>> by_task;
    for (ValueId v = 0; v < in_.size(); ++v)
      if (stage(v) == s && !is_input(v)) by_task[task(v)].push_back(v);
    for (const auto& t : stage_tasks(st_.schedule, s, st_.stages, microbatches_)) {
      auto it = by_task.find(t);
      if (it == by_task.end()) continue;
      for (ValueId v : it->second) on(s, v);
      by_task.erase(it);
    }
    if (!by_task.empty())
      internal_error("pipeline: stage " + std::to_string(s) + " has ops of a task its schedule does not run");
    for (auto i : outputs_on_[s]) on(s, in_.outputs()[static_cast<std::size_t>(i)].value);
  }

  // One program holding every stage's sequence in order, found by running them as devices do.
  SpmdProgram interleave() {
    SpmdProgram out(in_.name(), in_.mesh());
    std::vector<ValueId> id(nodes_.size(), -1);
    auto emit = [&](int node) {
      SpmdOp op = nodes_[static_cast<std::size_t>(node)].op;
      for (auto& o : op.op.operands) o = id[static_cast<std::size_t>(o)];
      id[static_cast<std::size_t>(node)] = out.add(std::move(op));
    };
    for (const auto& [v, node] : inputs_) emit(node);
    std::vector<std::size_t> next(order_.size(), 0);
    for (bool progress = true; progress;) {
      progress = false;
      for (std::size_t s = 0; s < order_.size(); ++s)
        for (; next[s] < order_[s].size(); ++next[s]) {
          const int node = order_[s][next[s]];
          const SpmdOp& op = nodes_[static_cast<std::size_t>(node)].op;
          if (op.collective && op.collective->kind == CollectiveKind::recv &&
              id[static_cast<std::size_t>(op.op.operands[0])] < 0)
            break;
          emit(node);
          progress = true;
        }
    }
    for (std::size_t s = 0; s < order_.size(); ++s)
      if (next[s] < order_[s].size()) {
        const Node& waiting = nodes_[static_cast<std::size_t>(order_[s][next[s]])];
        user_error(st_.tactic_label + ": the stages wait on each other: stage " + std::to_string(s) + " waits for " +
                   prog_.label(source_[static_cast<std::size_t>(waiting.of)]) + " from stage " +
                   std::to_string(waiting.op.collective->peer) +
                   ", which that stage makes only after it has what stage " + std::to_string(s) +
                   " makes later (a stage boundary inside a value the schedule needs whole; assign the stages in model order)");
      }
    for (Binding b : in_.inputs()) {
      b.value = id[static_cast<std::size_t>(inputs_.at(b.value))];
      out.add_input(std::move(b));
    }
    for (Binding b : in_.outputs()) {
      const int s = stage(b.value) >= 0 ? stage(b.value) : outputs_on_.begin()->first;
      b.value = id[static_cast<std::size_t>(is_input(b.value) ? inputs_.at(b.value) : local_[static_cast<std::size_t>(s)][static_cast<std::size_t>(b.value)])];
      out.add_output(std::move(b));
    }
    out.set_pipeline({st_.axis, st_.stages, st_.schedule, microbatches_});
    return out;
  }

  SpmdProgram in_;
  const std::vector<ValueId>& source_;
  const Program& prog_;
  const PipelineStages& st_;
  std::vector<StageTask> tasks_;  // per global value
  std::vector<int> stage_;        // per lowered value
  std::vector<std::set<int>> needs_;
  std::map<int, std::vector<std::ptrdiff_t>> outputs_on_;  // stage -> indices of the outputs its devices return
  std::vector<std::vector<int>> local_;  // stage -> lowered value -> node
  std::vector<std::vector<int>> order_;  // stage -> its nodes in running order
  std::vector<Node> nodes_;
  std::map<ValueId, int> inputs_;
  std::map<std::pair<ValueId, int>, int> sends_;
  int microbatches_ = 1;
};

}  // namespace detail

PARTIR_ENTRY SpmdProgram cut_into_stages(SpmdProgram lowered, const std::vector<ValueId>& source, const Program& prog,
                                   const PipelineStages& stages) {
  return detail::StageCutter(std::move(lowered), source, prog, stages).run();
}
#endif

}  // namespace partir
